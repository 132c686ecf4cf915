//! containerDisk images as the model sees them: a reference checked the way
//! the registry client reads it, Kubernetes' pull policy, and which disk
//! formats a VM may boot from. Fetching them is `host::image`'s job.

use oci_client::Reference;

/// Kubernetes' `imagePullPolicy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PullPolicy {
    Always,
    IfNotPresent,
    Never,
}

impl PullPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Always => "Always",
            Self::IfNotPresent => "IfNotPresent",
            Self::Never => "Never",
        }
    }

    /// The policy as written, or Kubernetes' default: `Always` for a
    /// `:latest` or untagged image, else `IfNotPresent`.
    pub fn resolve(policy: Option<&str>, image: &str) -> Result<Self, String> {
        match policy {
            Some("Always") => Ok(Self::Always),
            Some("IfNotPresent") => Ok(Self::IfNotPresent),
            Some("Never") => Ok(Self::Never),
            Some(other) => Err(format!("{other:?} is not Always, IfNotPresent or Never")),
            None => {
                let r = parse_reference(image)?;
                let latest = r.digest().is_none() && r.tag().is_none_or(|t| t == "latest");
                Ok(if latest {
                    Self::Always
                } else {
                    Self::IfNotPresent
                })
            }
        }
    }
}

/// Checks an image reference the way the registry client will read it.
pub fn parse_reference(image: &str) -> Result<Reference, String> {
    if image.is_empty() || image.trim() != image {
        return Err("must be an image reference such as quay.io/org/disk:tag".into());
    }
    image.parse::<Reference>().map_err(|e| e.to_string())
}

/// qcow2 or raw, from the file's first bytes. A qcow2 that names another
/// file (a backing file or an external data file) is refused: QEMU would
/// open that host path for the guest.
pub fn disk_format(header: &[u8]) -> Result<&'static str, String> {
    if !header.starts_with(b"QFI\xfb") {
        return Ok("raw");
    }
    let be64 = |at: usize| {
        header
            .get(at..at + 8)
            .map(|b| u64::from_be_bytes(b.try_into().expect("8 bytes")))
    };
    let version = header
        .get(4..8)
        .map(|b| u32::from_be_bytes(b.try_into().expect("4 bytes")));
    match (version, be64(8)) {
        (Some(2 | 3), Some(0)) => {}
        (Some(2 | 3), Some(_)) => return Err("a qcow2 with a backing file is not allowed".into()),
        _ => return Err("not a qcow2 image kvirt can read".into()),
    }
    // Version 3: incompatible feature bit 2 is an external data file.
    if version == Some(3) && be64(72).is_none_or(|f| f & 0b100 != 0) {
        return Err("a qcow2 with an external data file is not allowed".into());
    }
    Ok("qcow2")
}

/// The size a guest sees of a disk whose first bytes are `header` and
/// whose file is `len` bytes: a qcow2's own (its header's `size`), else
/// the file's.
pub fn virtual_size(header: &[u8], len: u64) -> u64 {
    match header.get(24..32) {
        Some(b) if header.starts_with(b"QFI\xfb") => {
            u64::from_be_bytes(b.try_into().expect("8 bytes"))
        }
        _ => len,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn virtual_sizes_of_raw_and_qcow2() {
        let mut h = qcow2(3, 0, 0);
        h[24..32].copy_from_slice(&(5u64 << 30).to_be_bytes());
        assert_eq!(virtual_size(&h, 196_608), 5 << 30);
        assert_eq!(virtual_size(b"\0\0\0\0raw", 1 << 20), 1 << 20);
        assert_eq!(virtual_size(b"QFI\xfb", 7), 7, "a header cut short");
    }

    fn qcow2(version: u32, backing_offset: u64, incompatible: u64) -> Vec<u8> {
        let mut h = vec![0u8; 104];
        h[..4].copy_from_slice(b"QFI\xfb");
        h[4..8].copy_from_slice(&version.to_be_bytes());
        h[8..16].copy_from_slice(&backing_offset.to_be_bytes());
        h[72..80].copy_from_slice(&incompatible.to_be_bytes());
        h
    }

    #[test]
    fn disk_formats_and_refused_qcow2s() {
        assert_eq!(disk_format(b"\0\0\0\0whatever"), Ok("raw"));
        assert_eq!(disk_format(&qcow2(3, 0, 0)), Ok("qcow2"));
        assert_eq!(disk_format(&qcow2(2, 0, 0)), Ok("qcow2"));
        assert!(disk_format(&qcow2(3, 512, 0))
            .unwrap_err()
            .contains("backing file"));
        assert!(disk_format(&qcow2(3, 0, 4))
            .unwrap_err()
            .contains("data file"));
        assert!(disk_format(&qcow2(9, 0, 0)).is_err());
        assert!(disk_format(b"QFI\xfb\0").is_err());
    }

    #[test]
    fn pull_policy_defaults_follow_kubernetes() {
        let p = |pol, img| PullPolicy::resolve(pol, img);
        assert_eq!(p(None, "quay.io/x/fedora"), Ok(PullPolicy::Always));
        assert_eq!(p(None, "quay.io/x/fedora:latest"), Ok(PullPolicy::Always));
        assert_eq!(p(None, "quay.io/x/fedora:41"), Ok(PullPolicy::IfNotPresent));
        let pinned = format!("quay.io/x/fedora@sha256:{}", "a".repeat(64));
        assert_eq!(p(None, &pinned), Ok(PullPolicy::IfNotPresent));
        assert_eq!(p(Some("Never"), "x:1"), Ok(PullPolicy::Never));
        assert!(p(Some("Sometimes"), "x:1")
            .unwrap_err()
            .contains("Sometimes"));
        assert!(p(None, "quay.io/x/fe dora").is_err());
        assert!(p(None, "quay.io/x/fedora:").is_err());
        assert!(p(None, "").is_err());
    }
}

/// What one image may make kvirtd download and write: a registry is not
/// trusted to stay small.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImageLimits {
    /// One layer as downloaded (compressed).
    pub max_layer_bytes: u64,
    /// All layers as downloaded.
    pub max_image_bytes: u64,
    /// All layers unpacked: every byte that comes out of decompression.
    pub max_unpacked_bytes: u64,
    /// Files and directories in the unpacked image.
    pub max_entries: u64,
    /// One pull in all (the token, manifests and every layer): a slow
    /// registry holds a VM's start no longer; what it downloaded is kept
    /// and resumed by the next try.
    pub max_pull_seconds: u64,
}

impl Default for ImageLimits {
    fn default() -> Self {
        const GI: u64 = 1 << 30;
        Self {
            max_layer_bytes: 10 * GI,
            max_image_bytes: 20 * GI,
            max_unpacked_bytes: 40 * GI,
            max_entries: 100_000,
            max_pull_seconds: 3600,
        }
    }
}

impl ImageLimits {
    /// The layers' declared sizes checked before a byte is downloaded:
    /// their total, or why the image is refused.
    pub fn check_declared(&self, layers: &[(&str, i64)]) -> Result<u64, String> {
        let mut total: u64 = 0;
        for (digest, size) in layers {
            let size = u64::try_from(*size)
                .map_err(|_| format!("layer {digest} declares a negative size ({size})"))?;
            if size > self.max_layer_bytes {
                return Err(format!(
                    "layer {digest} declares {size} bytes, over the limit of {} per layer",
                    self.max_layer_bytes
                ));
            }
            total = total.saturating_add(size);
        }
        if total > self.max_image_bytes {
            return Err(format!(
                "the layers declare {total} bytes, over the limit of {} per image",
                self.max_image_bytes
            ));
        }
        Ok(total)
    }
}

#[cfg(test)]
mod limit_tests {
    use super::ImageLimits;

    #[test]
    fn declared_sizes_are_checked_per_layer_and_in_total() {
        let l = ImageLimits {
            max_layer_bytes: 100,
            max_image_bytes: 150,
            ..ImageLimits::default()
        };
        assert_eq!(l.check_declared(&[("a", 100), ("b", 50)]), Ok(150));
        assert!(l
            .check_declared(&[("a", 101)])
            .unwrap_err()
            .contains("layer a declares 101 bytes"));
        assert!(l
            .check_declared(&[("a", 100), ("b", 51)])
            .unwrap_err()
            .contains("declare 151 bytes"));
        assert!(l
            .check_declared(&[("a", -1)])
            .unwrap_err()
            .contains("negative"));
        let huge = [("a", i64::MAX); 4];
        assert!(ImageLimits::default().check_declared(&huge).is_err());
    }
}
