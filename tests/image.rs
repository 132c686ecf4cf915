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
    let images = OciImages::new(cache.clone(), vec![]);
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
    assert!(da.root.starts_with(cache.join("sha256")));
    assert_eq!(std::fs::read(&da.path).unwrap(), bytes);
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&da.path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o644, "world-readable, never writable");
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
    let partial = resumed.join("blobs").join(format!("{hex}.partial"));
    std::fs::write(&partial, &blob[..blob.len() / 2]).unwrap();
    let stale = resumed.join(".tmp/abc-1");
    std::fs::create_dir_all(&stale).unwrap();
    let again = OciImages::new(resumed.clone(), vec![]);
    assert!(!stale.exists(), "a crashed unpack is cleaned up at start");
    let d = again
        .disk(&image, PullPolicy::Always, None, None, &|_| {})
        .await
        .unwrap();
    assert_eq!(std::fs::read(&d.path).unwrap(), bytes);
    assert_eq!(d.digest, da.digest);

    let corrupt = tmp.path().join("corrupt");
    std::fs::create_dir_all(corrupt.join("blobs")).unwrap();
    let partial = corrupt.join("blobs").join(format!("{hex}.partial"));
    std::fs::write(&partial, vec![0u8; blob.len() / 2]).unwrap();
    let bad = OciImages::new(corrupt.clone(), vec![]);
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
    let images = OciImages::new(cache.clone(), vec![]);
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
            err.to_string().contains("registry: Not authorized"),
            "{err}"
        );
    }
    let d = pull(Some(user("s3cret"))).await.unwrap();
    assert_eq!(std::fs::read(&d.path).unwrap(), b"private bytes");

    // In the cache now, and still not for a VM without the credentials
    // (nor with wrong ones): the registry is asked, as a pull would.
    let before = std::fs::read_dir(cache.join("sha256")).unwrap().count();
    for wrong in [None, Some(user("wrong"))] {
        let err = pull(wrong).await.unwrap_err();
        assert!(
            err.to_string().contains("registry: Not authorized"),
            "{err}"
        );
    }
    let again = pull(Some(user("s3cret"))).await.unwrap();
    assert_eq!(again, d);
    let after = std::fs::read_dir(cache.join("sha256")).unwrap().count();
    assert_eq!(before, after);
}
