//! containerDisk images against a real registry (Debian's docker-registry,
//! started here on a loopback port): push, shared pulls, resumed and
//! corrupt downloads, and the pull policies.

use kvirt::core::image::PullPolicy;
use kvirt::host::image::{Images, OciImages, Progress};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

struct Registry {
    child: Child,
    port: u16,
    storage: PathBuf,
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_registry(dir: &Path) -> Option<Registry> {
    start_registry_with(dir, "")
}

/// A registry whose extra configuration is `extra` (YAML lines).
fn start_registry_with(dir: &Path, extra: &str) -> Option<Registry> {
    if Command::new("docker-registry")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("skipped: no docker-registry (tests/run-all installs it)");
        return None;
    }
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let storage = dir.join("registry");
    let config = dir.join("registry.yml");
    std::fs::write(
        &config,
        format!(
            "version: 0.1\nlog: {{level: warn, accesslog: {{disabled: true}}}}\nstorage: {{filesystem: {{rootdirectory: {}}}}}\nhttp: {{addr: 127.0.0.1:{port}}}\n{extra}",
            storage.display()
        ),
    )
    .unwrap();
    let child = Command::new("docker-registry")
        .arg("serve")
        .arg(&config)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "registry did not listen");
        std::thread::sleep(Duration::from_millis(50));
    }
    Some(Registry {
        child,
        port,
        storage,
    })
}

/// A layer's download in progress from `repository` (registry/path): per
/// registry and repository, so a slow registry holds up no other's.
fn partial_name(repository: &str, hex: &str) -> String {
    use sha2::{Digest, Sha256};
    let h = Sha256::digest(repository.as_bytes());
    let key: String = h.iter().take(16).map(|b| format!("{b:02x}")).collect();
    format!("{key}-{hex}.partial")
}

/// A cache that may pull from the tests' registry on the loopback.
fn local_images(dir: std::path::PathBuf) -> OciImages {
    OciImages::new(dir, vec![]).with_local_registries(vec!["127.0.0.1".into()])
}

/// The largest blob the registry stores: the disk layer.
fn layer_blob(storage: &Path) -> (String, Vec<u8>) {
    let mut best: Option<(String, Vec<u8>)> = None;
    let blobs = storage.join("docker/registry/v2/blobs/sha256");
    for prefix in std::fs::read_dir(blobs).unwrap().flatten() {
        for b in std::fs::read_dir(prefix.path()).unwrap().flatten() {
            let data = std::fs::read(b.path().join("data")).unwrap();
            if best.as_ref().is_none_or(|(_, d)| d.len() < data.len()) {
                best = Some((b.file_name().to_string_lossy().into_owned(), data));
            }
        }
    }
    best.unwrap()
}

fn counting(n: &AtomicUsize) -> impl Fn(Progress) + Send + Sync + '_ {
    move |p: Progress| {
        assert!(p.done <= p.total, "{p:?}");
        n.fetch_add(1, Ordering::Relaxed);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn container_disks_from_a_real_registry() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(registry) = start_registry(tmp.path()) else {
        return;
    };
    // A few MiB that do not compress away, so the download takes chunks.
    let disk = tmp.path().join("guest.raw");
    let bytes: Vec<u8> = (0..3u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(&disk, &bytes).unwrap();
    let image = format!("127.0.0.1:{}/kvirt/guest:1", registry.port);
    let url = kvirt::host::image::push_disk(std::slice::from_ref(&disk), &image, &[], None)
        .await
        .unwrap();
    assert!(url.contains("/v2/kvirt/guest/manifests/"), "{url}");

    // Two VMs starting together: one download, one copy in the cache.
    let cache = tmp.path().join("cache");
    let images = local_images(cache.clone());
    let (a, b) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let (pa, pb) = (counting(&a), counting(&b));
    let (da, db) = tokio::join!(
        images.disk(&image, PullPolicy::IfNotPresent, None, None, &pa),
        images.disk(&image, PullPolicy::IfNotPresent, None, None, &pb),
    );
    let (da, db) = (da.unwrap(), db.unwrap());
    assert_eq!(da, db);
    let (na, nb) = (a.load(Ordering::Relaxed), b.load(Ordering::Relaxed));
    assert!(
        (na > 0) != (nb > 0),
        "exactly one pull reports progress: {na} {nb}"
    );
    assert_eq!(da.format, "raw");
    assert_eq!(da.path, da.root.join("disk/guest.raw"));
    assert!(da.root.starts_with(cache.join("repos")));
    assert_eq!(std::fs::read(&da.path).unwrap(), bytes);
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&da.path), 0o600, "root's alone: a VM is given its own");
    assert_eq!(mode(&cache), 0o700, "no local user reaches the cache");
    let leftovers = std::fs::read_dir(cache.join("blobs")).unwrap().count();
    assert_eq!(leftovers, 0, "layers are dropped once unpacked");
    let missing = images
        .disk(
            &image,
            PullPolicy::IfNotPresent,
            Some("disk/other.img"),
            None,
            &|_| {},
        )
        .await
        .unwrap_err();
    assert!(
        missing
            .to_string()
            .contains("/disk/other.img is not a file"),
        "{missing}"
    );

    // A download cut short by a restart resumes where it stopped; a
    // partial file with wrong bytes is caught by the digest and dropped.
    let (hex, blob) = layer_blob(&registry.storage);
    let resumed = tmp.path().join("resumed");
    std::fs::create_dir_all(resumed.join("blobs")).unwrap();
    let guest = format!("127.0.0.1:{}/kvirt/guest", registry.port);
    let partial = resumed.join("blobs").join(partial_name(&guest, &hex));
    std::fs::write(&partial, &blob[..blob.len() / 2]).unwrap();
    let stale = resumed.join(".tmp/abc-1");
    std::fs::create_dir_all(&stale).unwrap();
    let again = local_images(resumed.clone());
    assert!(!stale.exists(), "a crashed unpack is cleaned up at start");
    let d = again
        .disk(&image, PullPolicy::Always, None, None, &|_| {})
        .await
        .unwrap();
    assert_eq!(std::fs::read(&d.path).unwrap(), bytes);
    assert_eq!(d.digest, da.digest);

    let corrupt = tmp.path().join("corrupt");
    std::fs::create_dir_all(corrupt.join("blobs")).unwrap();
    let partial = corrupt.join("blobs").join(partial_name(&guest, &hex));
    std::fs::write(&partial, vec![0u8; blob.len() / 2]).unwrap();
    let bad = local_images(corrupt.clone());
    let err = bad
        .disk(&image, PullPolicy::Always, None, None, &|_| {})
        .await
        .unwrap_err();
    assert!(err.to_string().contains("arrived with digest"), "{err}");
    assert!(!partial.exists());
    bad.disk(&image, PullPolicy::Always, None, None, &|_| {})
        .await
        .unwrap();

    // The registry goes away: what is cached still starts (IfNotPresent),
    // Always needs the registry, Never never asks it.
    drop(registry);
    let cached = images
        .disk(&image, PullPolicy::IfNotPresent, None, None, &|_| {})
        .await
        .unwrap();
    assert_eq!(cached, da);
    let err = images
        .disk(&image, PullPolicy::Always, None, None, &|_| {})
        .await
        .unwrap_err();
    assert!(err.to_string().contains("registry"), "{err}");
    let empty = OciImages::new(tmp.path().join("empty"), vec![]);
    let err = empty
        .disk(&image, PullPolicy::Never, None, None, &|_| {})
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("imagePullPolicy is Never"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn private_images_need_their_credentials_even_from_the_cache() {
    use kvirt::core::pullsecret::Credentials;
    let tmp = tempfile::tempdir().unwrap();
    let htpasswd = tmp.path().join("htpasswd");
    let hash = bcrypt::hash("s3cret", 4).unwrap();
    std::fs::write(&htpasswd, format!("vmuser:{hash}\n")).unwrap();
    let extra = format!(
        "auth: {{htpasswd: {{realm: kvirt-test, path: {}}}}}\n",
        htpasswd.display()
    );
    let Some(registry) = start_registry_with(tmp.path(), &extra) else {
        return;
    };
    let disk = tmp.path().join("private.raw");
    std::fs::write(&disk, b"private bytes").unwrap();
    let image = format!("127.0.0.1:{}/team/private:1", registry.port);
    let user = |password: &str| Credentials {
        username: "vmuser".into(),
        password: password.into(),
    };
    let files = std::slice::from_ref(&disk);
    let err = kvirt::host::image::push_disk(files, &image, &[], None)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("registry"), "{err}");
    kvirt::host::image::push_disk(files, &image, &[], Some(&user("s3cret")))
        .await
        .unwrap();

    let cache = tmp.path().join("cache");
    let images = local_images(cache.clone());
    let pull = |auth: Option<Credentials>| {
        let images = &images;
        let image = image.clone();
        async move {
            images
                .disk(
                    &image,
                    PullPolicy::IfNotPresent,
                    None,
                    auth.as_ref(),
                    &|_| {},
                )
                .await
        }
    };
    for wrong in [None, Some(user("wrong"))] {
        let err = pull(wrong).await.unwrap_err();
        assert!(
            err.to_string().contains("registry: not authorized"),
            "{err}"
        );
    }
    let d = pull(Some(user("s3cret"))).await.unwrap();
    assert_eq!(std::fs::read(&d.path).unwrap(), b"private bytes");

    // In the cache now, and still not for a VM without the credentials
    // (nor with wrong ones): the registry is asked, as a pull would.
    let before = snapshot(&cache);
    for wrong in [None, Some(user("wrong"))] {
        let err = pull(wrong).await.unwrap_err();
        assert!(
            err.to_string().contains("registry: not authorized"),
            "{err}"
        );
    }
    let again = pull(Some(user("s3cret"))).await.unwrap();
    assert_eq!(again, d);
    assert_eq!(before, snapshot(&cache));

    // The same digest named through another repository of this registry,
    // or through another registry that lacks it: neither reaches the
    // cached private image.
    let digest = d.digest.clone();
    let public_dir = tmp.path().join("public");
    std::fs::create_dir_all(&public_dir).unwrap();
    let public = start_registry(&public_dir).unwrap();
    for other in [
        format!("127.0.0.1:{}/team/public@{digest}", registry.port),
        format!("127.0.0.1:{}/team/private@{digest}", public.port),
    ] {
        let err = images
            .disk(&other, PullPolicy::IfNotPresent, None, None, &|_| {})
            .await
            .unwrap_err();
        assert!(err.to_string().contains("registry"), "{other}: {err}");
    }
    assert_eq!(before, snapshot(&cache));
}

/// Every file under `dir` with its size: what a failed pull must not change.
fn snapshot(dir: &Path) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let m = e.metadata().unwrap();
            let rel = e.path().strip_prefix(dir).unwrap().display().to_string();
            if m.is_dir() {
                stack.push(e.path());
                out.push((rel, 0));
            } else {
                out.push((rel, m.len()));
            }
        }
    }
    out.sort();
    out
}

/// Pushes an image of these gzipped layers, each declared with its size
/// plus `skew` (a hostile manifest), and returns its reference.
async fn push_layers(port: u16, repo: &str, layers: Vec<Vec<u8>>, skew: i64) -> String {
    use oci_client::client::{ClientConfig, ClientProtocol, Config, ImageLayer};
    use oci_client::manifest::OciImageManifest;
    let image = format!("127.0.0.1:{port}/{repo}:1");
    let r: oci_client::Reference = image.parse().unwrap();
    let layers: Vec<ImageLayer> = layers
        .into_iter()
        .map(|l| ImageLayer::oci_v1_gzip(l, None))
        .collect();
    let config = Config::oci_v1(br#"{"architecture":"amd64","os":"linux"}"#.to_vec(), None);
    let mut manifest = OciImageManifest::build(&layers, &config, None);
    for l in &mut manifest.layers {
        l.size += skew;
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = oci_client::Client::new(ClientConfig {
        protocol: ClientProtocol::Http,
        ..Default::default()
    });
    client
        .push(
            &r,
            &layers,
            config,
            &oci_client::secrets::RegistryAuth::Anonymous,
            Some(manifest),
        )
        .await
        .unwrap();
    image
}

/// One gzipped layer holding `disk/<name>` with `data`.
fn disk_layer(name: &str, data: &[u8]) -> Vec<u8> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    {
        let mut tar = tar::Builder::new(&mut gz);
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o444);
        tar.append_data(&mut h, format!("disk/{name}"), data)
            .unwrap();
        tar.finish().unwrap();
    }
    gz.finish().unwrap()
}

/// A hostile registry's images: a layer declared huge, a layer bigger
/// than it declares, a decompression bomb. Each fails as too big, and the
/// cache is byte for byte what it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_images_fail_cleanly_and_leave_the_cache_as_it_was() {
    use kvirt::core::image::ImageLimits;
    let tmp = tempfile::tempdir().unwrap();
    let Some(registry) = start_registry(tmp.path()) else {
        return;
    };
    let limits = ImageLimits {
        max_layer_bytes: 4 << 20,
        max_image_bytes: 6 << 20,
        max_unpacked_bytes: 8 << 20,
        max_entries: 100,
        ..ImageLimits::default()
    };
    let cache = tmp.path().join("cache");
    let images = local_images(cache.clone()).with_limits(limits);
    let pull = |image: String| {
        let images = &images;
        async move {
            images
                .disk(&image, PullPolicy::IfNotPresent, None, None, &|_| {})
                .await
        }
    };
    let good = push_layers(
        registry.port,
        "ok/guest",
        vec![disk_layer("a.raw", &[7u8; 4096])],
        0,
    )
    .await;
    pull(good).await.unwrap();
    let before = snapshot(&cache);

    let noise: Vec<u8> = (0..1u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let declared_huge = push_layers(
        registry.port,
        "bad/huge",
        vec![disk_layer("a.raw", &noise)],
        1 << 40,
    )
    .await;
    let bigger = push_layers(
        registry.port,
        "bad/bigger",
        vec![disk_layer("b.raw", &noise)],
        -4096,
    )
    .await;
    let bomb = push_layers(
        registry.port,
        "bad/bomb",
        vec![disk_layer("c.raw", &vec![0u8; 64 << 20])],
        0,
    )
    .await;
    for (image, why) in [
        (declared_huge, "declares"),
        (bigger, "larger than the"),
        (bomb, "unpacks to more than 8388608 bytes"),
    ] {
        let err = pull(image.clone()).await.unwrap_err().to_string();
        assert!(
            err.contains("too big") && err.contains(why),
            "{image}: {err}"
        );
        assert_eq!(before, snapshot(&cache), "{image} left something");
    }
}

/// Two references to one digest (its tag and the digest itself) pulled at
/// once, again and again: one complete entry, nothing left over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_pulls_of_one_digest_make_one_correct_entry() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(registry) = start_registry(tmp.path()) else {
        return;
    };
    let data: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8).collect();
    let tag = push_layers(
        registry.port,
        "race/guest",
        vec![disk_layer("d.raw", &data)],
        0,
    )
    .await;
    for round in 0..8 {
        let cache = tmp.path().join(format!("cache{round}"));
        let images = local_images(cache.clone());
        let first = images
            .disk(&tag, PullPolicy::Always, None, None, &|_| {})
            .await
            .unwrap();
        std::fs::remove_dir_all(&cache).unwrap();
        let by_digest = format!("{}@{}", tag.trim_end_matches(":1"), first.digest);
        let (a, b) = tokio::join!(
            images.disk(&tag, PullPolicy::Always, None, None, &|_| {}),
            images.disk(&by_digest, PullPolicy::IfNotPresent, None, None, &|_| {}),
        );
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!(a.path, b.path, "round {round}");
        assert_eq!(std::fs::read(&a.path).unwrap(), data);
        let entries: Vec<_> = snapshot(&cache)
            .into_iter()
            .filter(|(p, _)| p.starts_with("repos/") && p.matches('/').count() == 2)
            .collect();
        assert_eq!(entries.len(), 1, "round {round}: {entries:?}");
        assert_eq!(
            std::fs::read_dir(cache.join(".tmp")).map_or(0, |d| d.count()),
            0
        );
        assert_eq!(
            std::fs::read_dir(cache.join("blobs")).map_or(0, |d| d.count()),
            0
        );
    }
}
