//! Files below a directory that a VM's user can write, as root reaches them
//! (libpathrs and crun's `safe_openat` are the model): through the
//! directory's fd with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`, so
//! no planted link, `..` or magic link leads out; never blocking on a FIFO
//! (`O_NONBLOCK`), only regular files read, and never more than asked;
//! ownership and modes changed through the fd, never by name.
//!
//! Where `openat2` is missing (a kernel before 5.6, or a seccomp filter that
//! answers `ENOSYS`, as systemd-nspawn 252's does), the same rules hold one
//! component at a time: each opened with `O_NOFOLLOW` beneath the last,
//! `..` and absolute paths refused.

use nix::errno::Errno;
use nix::fcntl::{openat, openat2, renameat, OFlag, OpenHow, ResolveFlag, AT_FDCWD};
use nix::sys::stat::{fchmod, fstat, mkdirat, Mode, SFlag};
use nix::unistd::{fchown, unlinkat, Gid, Uid, UnlinkatFlags};
use std::ffi::OsString;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

/// A uid and gid to give what is made or handed over.
pub type Ids = (u32, u32);

/// An open directory; everything below it is reached through its fd.
#[derive(Debug)]
pub struct Beneath {
    fd: OwnedFd,
    /// For messages only: nothing is ever opened by this name again.
    path: PathBuf,
}

/// The flags every open beneath takes: no following, no waiting.
fn safe(flags: OFlag) -> OFlag {
    flags | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK
}

/// Set once `openat2` answered `ENOSYS`: from then on, [`walk`].
static NO_OPENAT2: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// `rel` below `dir`, opened with exactly `flags` (and `mode` for a new
/// file), never leaving `dir` and never through a link.
fn open_beneath(dir: &OwnedFd, rel: &Path, flags: OFlag, mode: Mode) -> io::Result<OwnedFd> {
    use std::sync::atomic::Ordering::Relaxed;
    if !NO_OPENAT2.load(Relaxed) {
        let how = OpenHow::new().flags(flags).mode(mode).resolve(
            ResolveFlag::RESOLVE_BENEATH
                | ResolveFlag::RESOLVE_NO_SYMLINKS
                | ResolveFlag::RESOLVE_NO_MAGICLINKS,
        );
        match openat2(dir, rel, how) {
            Err(Errno::ENOSYS) => NO_OPENAT2.store(true, Relaxed),
            r => return Ok(r?),
        }
    }
    walk(dir, rel, flags, mode)
}

/// [`open_beneath`] without `openat2`: every directory on the way opened
/// with `O_NOFOLLOW` (a link there fails as not a directory), the last
/// component too; `..` and absolute paths leave, so they are refused.
fn walk(dir: &OwnedFd, rel: &Path, flags: OFlag, mode: Mode) -> io::Result<OwnedFd> {
    use std::path::Component;
    let mut names = Vec::new();
    for c in rel.components() {
        match c {
            Component::Normal(n) => names.push(n),
            Component::CurDir => {}
            _ => return Err(Errno::EXDEV.into()),
        }
    }
    let Some((last, on_the_way)) = names.split_last() else {
        return Ok(openat(dir, ".", flags, mode)?);
    };
    let step = OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let mut cur: Option<OwnedFd> = None;
    for name in on_the_way {
        let next = match &cur {
            None => openat(dir, *name, step, Mode::empty()),
            Some(c) => openat(c, *name, step, Mode::empty()),
        }?;
        cur = Some(next);
    }
    let fd = match &cur {
        None => openat(dir, *last, flags | OFlag::O_NOFOLLOW, mode),
        Some(c) => openat(c, *last, flags | OFlag::O_NOFOLLOW, mode),
    }?;
    Ok(fd)
}

fn not_regular(what: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("{} is not a regular file", what.display()),
    )
}

fn is(fd: impl AsFd, kind: SFlag) -> io::Result<bool> {
    let st = fstat(fd)?;
    Ok(SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == kind)
}

fn give(fd: impl AsFd, mode: Option<u32>, owner: Option<Ids>) -> io::Result<()> {
    if let Some((uid, gid)) = owner {
        fchown(&fd, Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid)))?;
    }
    if let Some(m) = mode {
        fchmod(&fd, Mode::from_bits_truncate(m))?;
    }
    Ok(())
}

impl std::os::fd::AsFd for Beneath {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl Beneath {
    /// Opens `path`, which must be a directory and not a link. Its parents
    /// are trusted: only root can change them (`/run/kvirt/vms` and the
    /// like), so a VM's own directory is opened by name here, once.
    pub fn open(path: &Path) -> io::Result<Self> {
        let fd = nix::fcntl::open(
            path,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )?;
        Ok(Self {
            fd,
            path: path.to_owned(),
        })
    }

    /// The uid owning this directory (by its fd).
    pub fn owner(&self) -> io::Result<u32> {
        Ok(nix::sys::stat::fstat(&self.fd)?.st_uid)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The directory `rel` below this one.
    pub fn dir(&self, rel: impl AsRef<Path>) -> io::Result<Self> {
        let rel = rel.as_ref();
        let flags = safe(OFlag::O_RDONLY | OFlag::O_DIRECTORY);
        let fd = open_beneath(&self.fd, rel, flags, Mode::empty())?;
        Ok(Self {
            fd,
            path: self.path.join(rel),
        })
    }

    /// The regular file `rel`, opened with `flags` (`O_RDONLY`, `O_RDWR`,
    /// `O_WRONLY | O_APPEND`...); a FIFO, device, socket or directory there
    /// is an error, and opening it never blocks.
    pub fn file(&self, rel: impl AsRef<Path>, flags: OFlag) -> io::Result<File> {
        let rel = rel.as_ref();
        let fd = open_beneath(&self.fd, rel, safe(flags), Mode::empty())?;
        if !is(&fd, SFlag::S_IFREG)? {
            return Err(not_regular(&self.path.join(rel)));
        }
        Ok(File::from(fd))
    }

    /// The whole of the regular file `rel`, refused when larger than `max`.
    pub fn read(&self, rel: impl AsRef<Path>, max: u64) -> io::Result<Vec<u8>> {
        let rel = rel.as_ref();
        let f = self.file(rel, OFlag::O_RDONLY)?;
        let mut buf = Vec::new();
        f.take(max + 1).read_to_end(&mut buf)?;
        if buf.len() as u64 > max {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{} is larger than {max} bytes",
                    self.path.join(rel).display()
                ),
            ));
        }
        Ok(buf)
    }

    /// The directory `name` (one component), made if missing, with this
    /// mode and owner whether new or not.
    pub fn mkdir(&self, name: &str, mode: u32, owner: Option<Ids>) -> io::Result<Self> {
        one_component(name)?;
        match mkdirat(&self.fd, name, Mode::from_bits_truncate(0o700)) {
            Ok(()) | Err(Errno::EEXIST) => {}
            Err(e) => return Err(e.into()),
        }
        let d = self.dir(name)?;
        give(&d.fd, Some(mode), owner)?;
        Ok(d)
    }

    /// Every directory of `rel` below this one, made as [`Beneath::mkdir`].
    pub fn mkdir_all(
        &self,
        rel: impl AsRef<Path>,
        mode: u32,
        owner: Option<Ids>,
    ) -> io::Result<Self> {
        let mut names = rel.as_ref().components().map(|c| match c {
            std::path::Component::Normal(n) => n.to_str().ok_or_else(|| bad_name(c.as_os_str())),
            _ => Err(bad_name(c.as_os_str())),
        });
        let Some(first) = names.next() else {
            return self.dir(".");
        };
        let mut d = self.mkdir(first?, mode, owner)?;
        for n in names {
            d = d.mkdir(n?, mode, owner)?;
        }
        Ok(d)
    }

    /// Every directory of `rel` below this one that is missing, made with
    /// `mode` and root's; those that exist are left exactly as they are
    /// (they may be someone else's, e.g. below a hostDisk root).
    pub fn make_missing(&self, rel: impl AsRef<Path>, mode: u32) -> io::Result<Self> {
        let mut d = self.dir(".")?;
        for c in rel.as_ref().components() {
            let std::path::Component::Normal(name) = c else {
                return Err(bad_name(c.as_os_str()));
            };
            match mkdirat(&d.fd, name, Mode::from_bits_truncate(0o700)) {
                Ok(()) => {
                    let new = d.dir(name)?;
                    give(&new.fd, Some(mode), None)?;
                    d = new;
                }
                Err(Errno::EEXIST) => d = d.dir(name)?,
                Err(e) => return Err(e.into()),
            }
        }
        Ok(d)
    }

    /// A new regular file `name` here, opened for writing; anything
    /// already there (a file, a link, a FIFO) is `AlreadyExists`.
    pub fn create(&self, name: &str, mode: u32) -> io::Result<File> {
        one_component(name)?;
        let fd = open_beneath(
            &self.fd,
            Path::new(name),
            safe(OFlag::O_RDWR | OFlag::O_CREAT | OFlag::O_EXCL),
            Mode::from_bits_truncate(mode),
        )?;
        Ok(File::from(fd))
    }

    /// Replaces `name` with `data` whole: a new file beside it, then a
    /// rename, which replaces whatever was planted there (a link included)
    /// without following it.
    pub fn write(&self, name: &str, data: &[u8], mode: u32, owner: Option<Ids>) -> io::Result<()> {
        one_component(name)?;
        let tmp = format!(".{name}.kvirt-{}", std::process::id());
        let _ = unlinkat(&self.fd, tmp.as_str(), UnlinkatFlags::NoRemoveDir);
        let fd = open_beneath(
            &self.fd,
            Path::new(&tmp),
            safe(OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL),
            Mode::from_bits_truncate(0o600),
        )?;
        let mut f = File::from(fd);
        let written = f
            .write_all(data)
            .and_then(|()| give(&f, Some(mode), owner))
            .and_then(|()| f.sync_all())
            .and_then(|()| Ok(renameat(&self.fd, tmp.as_str(), &self.fd, name)?));
        if written.is_err() {
            let _ = unlinkat(&self.fd, tmp.as_str(), UnlinkatFlags::NoRemoveDir);
        }
        written
    }

    /// Moves `from` (a file of root's, e.g. in a root-only staging
    /// directory) to `name` here, replacing what is there.
    pub fn rename_in(&self, from: &Path, name: &str) -> io::Result<()> {
        one_component(name)?;
        Ok(renameat(AT_FDCWD, from, &self.fd, name)?)
    }

    /// Gives `rel` (a regular file or a directory) this owner and mode.
    pub fn set(
        &self,
        rel: impl AsRef<Path>,
        mode: Option<u32>,
        owner: Option<Ids>,
    ) -> io::Result<()> {
        let rel = rel.as_ref();
        let fd = open_beneath(&self.fd, rel, safe(OFlag::O_RDONLY), Mode::empty())?;
        if !(is(&fd, SFlag::S_IFREG)? || is(&fd, SFlag::S_IFDIR)?) {
            return Err(not_regular(&self.path.join(rel)));
        }
        give(&fd, mode, owner)
    }

    /// The unix socket `rel`, to connect to by [`SocketPath::path`]: the
    /// socket found beneath this directory, never one a link points at
    /// (`connect()` by name would follow it).
    pub fn socket(&self, rel: impl AsRef<Path>) -> io::Result<SocketPath> {
        let rel = rel.as_ref();
        // O_PATH takes no other flags with openat2.
        let flags = OFlag::O_PATH | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW;
        let fd = open_beneath(&self.fd, rel, flags, Mode::empty())?;
        if !is(&fd, SFlag::S_IFSOCK)? {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{} is not a socket", self.path.join(rel).display()),
            ));
        }
        Ok(SocketPath(fd))
    }

    /// A unix socket `name` here, bound and listening, then given to
    /// `owner` without following a link (only this directory's writers
    /// could swap one in: keep it root's). Anything already at the name is
    /// `AddrInUse`, never replaced.
    pub fn bind_socket(
        &self,
        name: &str,
        owner: Option<Ids>,
    ) -> io::Result<std::os::unix::net::UnixListener> {
        use std::os::fd::AsRawFd;
        one_component(name)?;
        // Through this process's fd of the directory: bound exactly here.
        let path = format!("/proc/self/fd/{}/{name}", self.fd.as_raw_fd());
        let listener = std::os::unix::net::UnixListener::bind(path)?;
        self.give_name(name, owner)?;
        Ok(listener)
    }

    /// Gives what `name` is now to `owner`, never following a link.
    fn give_name(&self, name: &str, owner: Option<Ids>) -> io::Result<()> {
        if let Some((uid, gid)) = owner {
            nix::unistd::fchownat(
                &self.fd,
                name,
                Some(Uid::from_raw(uid)),
                Some(Gid::from_raw(gid)),
                nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
            )?;
        }
        Ok(())
    }

    /// A block device node `name` of `rdev` here, with `mode` and
    /// `owner`; the owner is set on what the name is then without
    /// following a link (one swapped in meanwhile only gets the owner
    /// itself).
    pub fn mknod_block(
        &self,
        name: &str,
        mode: u32,
        rdev: u64,
        owner: Option<Ids>,
    ) -> io::Result<()> {
        one_component(name)?;
        nix::sys::stat::mknodat(
            &self.fd,
            name,
            SFlag::S_IFBLK,
            Mode::from_bits_truncate(mode),
            rdev,
        )?;
        self.give_name(name, owner)
    }

    /// Removes the file (or link, or FIFO) `name`; one that is not there is fine.
    pub fn remove(&self, name: &str) -> io::Result<()> {
        one_component(name)?;
        match unlinkat(&self.fd, name, UnlinkatFlags::NoRemoveDir) {
            Ok(()) | Err(Errno::ENOENT) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// The names in this directory, `.` and `..` left out.
    pub fn entries(&self) -> io::Result<Vec<OsString>> {
        use std::os::unix::ffi::OsStrExt;
        let flags = safe(OFlag::O_RDONLY | OFlag::O_DIRECTORY);
        let fd = open_beneath(&self.fd, Path::new("."), flags, Mode::empty())?;
        let mut dir = nix::dir::Dir::from_fd(fd)?;
        let mut names = Vec::new();
        for e in dir.iter() {
            let name = e?.file_name().to_bytes().to_owned();
            if name != b"." && name != b".." {
                names.push(std::ffi::OsStr::from_bytes(&name).to_owned());
            }
        }
        names.sort();
        Ok(names)
    }
}

/// A socket opened beneath a directory; its path goes through this
/// process's fd table, so connecting reaches exactly the socket found.
#[derive(Debug)]
pub struct SocketPath(OwnedFd);

impl SocketPath {
    pub fn path(&self) -> PathBuf {
        use std::os::fd::AsRawFd;
        PathBuf::from(format!("/proc/self/fd/{}", self.0.as_raw_fd()))
    }

    /// Who listens on it: the pid and uid the kernel recorded when the
    /// socket was made to listen (`SO_PEERCRED` of a connection to it).
    pub fn listener(&self) -> io::Result<(i32, u32)> {
        let s = std::os::unix::net::UnixStream::connect(self.path())?;
        let cred = nix::sys::socket::getsockopt(&s, nix::sys::socket::sockopt::PeerCredentials)?;
        Ok((cred.pid(), cred.uid()))
    }
}

fn bad_name(name: &std::ffi::OsStr) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("{name:?} is not a plain file name"),
    )
}

fn one_component(name: &str) -> io::Result<()> {
    if name.is_empty() || name == "." || name == ".." || name.contains('/') {
        return Err(bad_name(name.as_ref()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn setup() -> (tempfile::TempDir, Beneath) {
        let t = tempfile::tempdir().unwrap();
        let b = Beneath::open(t.path()).unwrap();
        (t, b)
    }

    #[test]
    fn a_socket_is_bound_where_the_directory_is_and_never_over_a_planted_name() {
        let (t, b) = setup();
        let sub = b.mkdir("m", 0o755, None).unwrap();
        std::os::unix::fs::symlink("/tmp/elsewhere.sock", t.path().join("m/taken.sock")).unwrap();
        let e = sub.bind_socket("taken.sock", None).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AddrInUse, "{e}");
        assert!(!Path::new("/tmp/elsewhere.sock").exists());
        let l = sub.bind_socket("ok.sock", None).unwrap();
        std::os::unix::net::UnixStream::connect(t.path().join("m/ok.sock")).unwrap();
        drop(l);
        assert!(sub.bind_socket("../x.sock", None).is_err());
    }

    #[test]
    fn links_out_are_never_followed() {
        let (t, b) = setup();
        let outside = tempfile::tempdir().unwrap();
        let secret = outside.path().join("secret");
        std::fs::write(&secret, "root's").unwrap();
        let mode = || std::fs::metadata(&secret).unwrap().permissions().mode();
        let before = mode();
        std::os::unix::fs::symlink(&secret, t.path().join("link")).unwrap();
        std::os::unix::fs::symlink(outside.path(), t.path().join("dirlink")).unwrap();
        std::fs::create_dir(t.path().join("sub")).unwrap();
        std::os::unix::fs::symlink("../link", t.path().join("sub/rel")).unwrap();

        assert!(b.read("link", 100).is_err());
        assert!(b.read("dirlink/secret", 100).is_err());
        assert!(b.read("sub/rel", 100).is_err());
        assert!(b.read("../x", 100).is_err());
        assert!(
            b.read(&secret, 100).is_err(),
            "an absolute path is not beneath"
        );
        assert!(b.dir("dirlink").is_err());
        assert!(b.mkdir("dirlink", 0o700, None).is_err());
        assert!(b.mkdir_all("dirlink/new", 0o700, None).is_err());
        assert!(!outside.path().join("new").exists());
        assert!(b.set("link", Some(0o777), None).is_err());
        assert_eq!(mode(), before, "mode untouched");
        // Writing over a planted link replaces the link, never its target.
        b.write("link", b"new", 0o600, None).unwrap();
        assert_eq!(std::fs::read_to_string(&secret).unwrap(), "root's");
        assert_eq!(
            std::fs::read_to_string(t.path().join("link")).unwrap(),
            "new"
        );
        assert!(!t.path().join("link").is_symlink());
        // Removing a link removes the link.
        std::os::unix::fs::symlink(&secret, t.path().join("link2")).unwrap();
        b.remove("link2").unwrap();
        assert!(secret.exists());
    }

    #[test]
    fn fifos_and_devices_are_refused_without_blocking() {
        let (t, b) = setup();
        nix::unistd::mkfifo(&t.path().join("fifo"), Mode::from_bits_truncate(0o600)).unwrap();
        let e = b.read("fifo", 100).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        assert!(b.file("fifo", OFlag::O_RDONLY).is_err());
        assert!(b.set("fifo", Some(0o600), None).is_err());
        let dev = Beneath::open(Path::new("/dev")).unwrap();
        assert!(dev.read("zero", 100).is_err(), "a device is not a file");
    }

    #[test]
    fn reads_are_bounded() {
        let (t, b) = setup();
        std::fs::write(t.path().join("big"), vec![b'x'; 4096]).unwrap();
        assert_eq!(b.read("big", 4096).unwrap().len(), 4096);
        let e = b.read("big", 4095).unwrap_err();
        assert!(e.to_string().contains("larger than 4095"), "{e}");
    }

    #[test]
    fn made_and_written_things_get_their_mode_and_owner() {
        let (t, b) = setup();
        let me = (
            nix::unistd::getuid().as_raw(),
            nix::unistd::getgid().as_raw(),
        );
        let d = b.mkdir_all("a/b/c", 0o711, Some(me)).unwrap();
        assert_eq!(d.path(), t.path().join("a/b/c"));
        for p in ["a", "a/b", "a/b/c"] {
            let m = std::fs::metadata(t.path().join(p)).unwrap();
            assert_eq!(m.mode() & 0o777, 0o711, "{p}");
            assert_eq!(m.uid(), me.0);
        }
        // Again: fine, and the mode is set again.
        std::fs::set_permissions(t.path().join("a"), std::fs::Permissions::from_mode(0o777))
            .unwrap();
        b.mkdir_all("a/b", 0o700, None).unwrap();
        assert_eq!(
            std::fs::metadata(t.path().join("a")).unwrap().mode() & 0o777,
            0o700
        );
        d.write("f", b"data", 0o640, Some(me)).unwrap();
        let f = t.path().join("a/b/c/f");
        assert_eq!(std::fs::read(&f).unwrap(), b"data");
        assert_eq!(std::fs::metadata(&f).unwrap().mode() & 0o777, 0o640);
        assert_eq!(d.entries().unwrap(), [OsString::from("f")]);
        assert!(b.mkdir("a/b", 0o700, None).is_err(), "one name only");
        assert!(b.write("../f", b"", 0o600, None).is_err());
    }

    /// A link planted where a socket should be is refused; the socket
    /// itself is reached through the fd, whatever happens to its name.
    #[test]
    fn sockets_are_reached_beneath_and_never_through_a_link() {
        let (t, b) = setup();
        let elsewhere = tempfile::tempdir().unwrap();
        let real = std::os::unix::net::UnixListener::bind(t.path().join("s.sock")).unwrap();
        let other =
            std::os::unix::net::UnixListener::bind(elsewhere.path().join("o.sock")).unwrap();
        std::os::unix::fs::symlink(elsewhere.path().join("o.sock"), t.path().join("link.sock"))
            .unwrap();
        let sock = b.socket("s.sock").unwrap();
        std::os::unix::net::UnixStream::connect(sock.path()).unwrap();
        real.accept().unwrap();
        assert!(b.socket("link.sock").is_err());
        std::fs::write(t.path().join("file"), b"").unwrap();
        let e = b.socket("file").unwrap_err();
        assert!(e.to_string().contains("not a socket"), "{e}");
        other.set_nonblocking(true).unwrap();
        assert!(other.accept().is_err(), "nothing reached the other socket");
    }

    /// The resolver used where openat2 is missing keeps the same rules.
    #[test]
    fn without_openat2_links_and_dotdot_are_refused_too() {
        let (t, b) = setup();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), "root's").unwrap();
        std::fs::create_dir_all(t.path().join("a/b")).unwrap();
        std::fs::write(t.path().join("a/b/f"), "mine").unwrap();
        std::os::unix::fs::symlink(outside.path(), t.path().join("a/out")).unwrap();
        std::os::unix::fs::symlink(outside.path().join("secret"), t.path().join("a/link")).unwrap();
        let rd = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK;
        let read = |rel: &str| {
            walk(&b.fd, Path::new(rel), rd, Mode::empty()).map(|fd| {
                let mut s = String::new();
                File::from(fd).read_to_string(&mut s).unwrap();
                s
            })
        };
        assert_eq!(read("a/b/f").unwrap(), "mine");
        assert_eq!(read("./a/b/f").unwrap(), "mine");
        for bad in ["a/out/secret", "a/link", "a/../a/b/f", "../x"] {
            assert!(read(bad).is_err(), "{bad}");
        }
        let abs = outside.path().join("secret");
        assert!(read(abs.to_str().unwrap()).is_err());
    }
}
