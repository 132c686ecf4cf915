//! The host's hugetlbfs mounts and free hugepages. Session-mode libvirt
//! finds no hugetlbfs of its own: each VM gets a directory of its own,
//! `<mount>/kvirt/<id>/`, named in its `qemu.conf`.

use std::path::{Path, PathBuf};

/// The hugetlbfs mount with pages of `page_bytes`, from `/proc/mounts`
/// text; a mount without `pagesize=` has the default size.
pub fn mount_for(mounts: &str, default_page_bytes: u64, page_bytes: u64) -> Option<PathBuf> {
    mounts.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        let [_, dir, "hugetlbfs", options, ..] = f.as_slice() else {
            return None;
        };
        let size = options
            .split(',')
            .find_map(|o| o.strip_prefix("pagesize="))
            .map_or(Some(default_page_bytes), parse_size)?;
        // /proc/mounts escapes spaces and the like as octal.
        (size == page_bytes && !dir.contains('\\')).then(|| PathBuf::from(dir))
    })
}

/// `2M`, `1024K`, `1G` (the kernel's pagesize= forms).
fn parse_size(s: &str) -> Option<u64> {
    let (n, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit())?);
    let shift = match unit {
        "K" | "k" => 10,
        "M" | "m" => 20,
        "G" | "g" => 30,
        _ => return None,
    };
    n.parse::<u64>().ok()?.checked_mul(1 << shift)
}

/// `Hugepagesize:` of `/proc/meminfo` text, in bytes.
pub fn default_page_bytes(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("Hugepagesize:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib << 10)
}

/// The VM's own directory on a hugetlbfs mount.
pub fn vm_dir(mount: &Path, id: &str) -> PathBuf {
    mount.join("kvirt").join(id)
}

/// This host's hugetlbfs for pages of `page_bytes`, with a reason when
/// there is none.
pub fn host_mount(page_bytes: u64) -> Result<PathBuf, String> {
    let mounts =
        std::fs::read_to_string("/proc/mounts").map_err(|e| format!("/proc/mounts: {e}"))?;
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let default = default_page_bytes(&meminfo).unwrap_or(2 << 20);
    mount_for(&mounts, default, page_bytes).ok_or_else(|| {
        format!(
            "no hugetlbfs of {} pages is mounted on this host",
            human(page_bytes)
        )
    })
}

/// Pages of that size nobody has yet: free and not reserved by a mapping
/// (a running VM's pages are reserved when QEMU maps them, and only
/// leave the free count once the guest touches them).
pub fn available_pages(page_bytes: u64) -> Result<u64, String> {
    let read = |name: &str| -> Result<u64, String> {
        let f = format!(
            "/sys/kernel/mm/hugepages/hugepages-{}kB/{name}",
            page_bytes >> 10
        );
        let text = std::fs::read_to_string(&f).map_err(|e| format!("{f}: {e}"))?;
        text.trim().parse().map_err(|_| format!("{f}: {text:?}"))
    };
    Ok(read("free_hugepages")?.saturating_sub(read("resv_hugepages")?))
}

/// Every hugetlbfs directory of VM `id` on this host (for teardown).
pub fn host_vm_dirs(id: &str) -> Vec<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    mounts
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            matches!(f.as_slice(), [_, _, "hugetlbfs", ..]).then(|| vm_dir(Path::new(f[1]), id))
        })
        .collect()
}

pub fn human(page_bytes: u64) -> String {
    if page_bytes >= 1 << 30 {
        format!("{} GiB", page_bytes >> 30)
    } else {
        format!("{} MiB", page_bytes >> 20)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTS: &str = "proc /proc proc rw 0 0
hugetlbfs /dev/hugepages hugetlbfs rw,relatime,pagesize=2M 0 0
none /mnt/huge1g hugetlbfs rw,pagesize=1024M 0 0
none /mnt/huge\\040x hugetlbfs rw,pagesize=4M 0 0
";

    #[test]
    fn mounts_are_found_by_page_size() {
        assert_eq!(
            mount_for(MOUNTS, 2 << 20, 2 << 20),
            Some("/dev/hugepages".into())
        );
        assert_eq!(
            mount_for(MOUNTS, 2 << 20, 1 << 30),
            Some("/mnt/huge1g".into())
        );
        assert_eq!(
            mount_for(MOUNTS, 2 << 20, 4 << 20),
            None,
            "escaped paths are skipped"
        );
        let default_only = "hugetlbfs /dev/hugepages hugetlbfs rw,relatime 0 0\n";
        assert_eq!(
            mount_for(default_only, 2 << 20, 2 << 20),
            Some("/dev/hugepages".into())
        );
        assert_eq!(mount_for(default_only, 2 << 20, 1 << 30), None);
        assert_eq!(mount_for("", 2 << 20, 2 << 20), None);
    }

    #[test]
    fn sizes_and_the_default_page() {
        assert_eq!(parse_size("2M"), Some(2 << 20));
        assert_eq!(parse_size("1G"), Some(1 << 30));
        assert_eq!(parse_size("2048K"), Some(2 << 20));
        assert_eq!(parse_size("x"), None);
        assert_eq!(parse_size("2"), None);
        assert_eq!(
            default_page_bytes("MemTotal: 1 kB\nHugepagesize:       2048 kB\n"),
            Some(2 << 20)
        );
        assert_eq!(
            vm_dir(Path::new("/dev/hugepages"), "ns_vm"),
            PathBuf::from("/dev/hugepages/kvirt/ns_vm")
        );
        assert_eq!(human(2 << 20), "2 MiB");
        assert_eq!(human(1 << 30), "1 GiB");
    }
}
