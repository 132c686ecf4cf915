//! kvirtd's own records of its VMs, as files kvirtd alone may read or
//! write (`<dir>/<id>.json`, 0600 in a 0700 directory), each replaced
//! whole: after a crash a record is the old or the new one. The
//! migrations this host takes part in (`/run/kvirt/migrations`) and the
//! VMs a self-fence stopped (`/run/kvirt/fenced`).

use crate::core::fence::Fenced;
use crate::core::migration::Mark;
use serde::{de::DeserializeOwned, Serialize};
use std::marker::PhantomData;
use std::path::PathBuf;

/// A record is a VMI at most, and a VMI is small: anything larger is not one.
const MAX_RECORD: u64 = 2 << 20;

#[derive(Debug, thiserror::Error)]
pub enum MarkError {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{what} {path}: {message}")]
    Invalid {
        what: &'static str,
        path: PathBuf,
        message: String,
    },
}

/// Each VM's record of one kind, by VM id.
pub trait Records<T>: Send + Sync + 'static {
    fn get(&self, id: &str) -> Result<Option<T>, MarkError>;
    /// Kept before this returns (and before what it records may start).
    fn set(&self, id: &str, record: &T) -> Result<(), MarkError>;
    fn clear(&self, id: &str) -> Result<(), MarkError>;
    /// Every record there is, by VM id (a bad one is said and skipped).
    fn all(&self) -> Vec<(String, T)>;
}

/// The real records: files in one directory.
#[derive(Debug)]
pub struct FileRecords<T> {
    pub dir: PathBuf,
    what: &'static str,
    kind: PhantomData<fn() -> T>,
}

impl<T> Clone for FileRecords<T> {
    fn clone(&self) -> Self {
        Self {
            dir: self.dir.clone(),
            what: self.what,
            kind: PhantomData,
        }
    }
}

/// Migration marks (`/run/kvirt/migrations`).
pub type FileMarks = FileRecords<Mark>;
/// Fence records (`/run/kvirt/fenced`).
pub type FileFences = FileRecords<Fenced>;

impl FileMarks {
    pub fn marks(dir: PathBuf) -> Self {
        Self::new(dir, "migration mark")
    }
}

impl FileFences {
    pub fn fences(dir: PathBuf) -> Self {
        Self::new(dir, "fence record")
    }
}

impl<T> FileRecords<T> {
    fn new(dir: PathBuf, what: &'static str) -> Self {
        Self {
            dir,
            what,
            kind: PhantomData,
        }
    }

    fn path(&self, id: &str) -> Result<PathBuf, MarkError> {
        // A VM id is `<ns>_<name>`: DNS labels, never a path.
        if id.is_empty()
            || !id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
            || id.starts_with('.')
        {
            return Err(self.invalid(self.dir.clone(), format!("{id:?} is not a VM id")));
        }
        Ok(self.dir.join(format!("{id}.json")))
    }

    fn invalid(&self, path: PathBuf, message: String) -> MarkError {
        MarkError::Invalid {
            what: self.what,
            path,
            message,
        }
    }

    fn io(&self, path: &std::path::Path) -> impl Fn(std::io::Error) -> MarkError + '_ {
        let path = path.to_owned();
        move |source| MarkError::Io {
            what: self.what,
            path: path.clone(),
            source,
        }
    }
}

impl<T: Serialize + DeserializeOwned + 'static> Records<T> for FileRecords<T> {
    fn get(&self, id: &str) -> Result<Option<T>, MarkError> {
        use std::io::Read;
        let path = self.path(id)?;
        let file = match std::fs::File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(self.io(&path)(e)),
        };
        let mut bytes = Vec::new();
        file.take(MAX_RECORD + 1)
            .read_to_end(&mut bytes)
            .map_err(self.io(&path))?;
        if bytes.len() as u64 > MAX_RECORD {
            return Err(self.invalid(path, format!("larger than {MAX_RECORD} bytes")));
        }
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| self.invalid(path, e.to_string()))
    }

    fn set(&self, id: &str, record: &T) -> Result<(), MarkError> {
        use std::os::unix::fs::DirBuilderExt;
        let path = self.path(id)?;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.dir)
            .map_err(self.io(&path))?;
        let bytes =
            serde_json::to_vec(record).map_err(|e| self.invalid(path.clone(), e.to_string()))?;
        crate::host::commit::replace_private(&path, &bytes).map_err(self.io(&path))
    }

    fn clear(&self, id: &str) -> Result<(), MarkError> {
        let path = self.path(id)?;
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(self.io(&path)(e)),
            _ => Ok(()),
        }
    }

    fn all(&self) -> Vec<(String, T)> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for name in entries.flatten().map(|e| e.file_name()) {
            let Some(id) = name.to_str().and_then(|n| n.strip_suffix(".json")) else {
                continue;
            };
            match self.get(id) {
                Ok(Some(m)) => out.push((id.to_string(), m)),
                Ok(None) => {}
                Err(e) => tracing::warn!("{e}"),
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::plan::Migrating;

    fn mark(role: Migrating) -> Mark {
        Mark {
            migration_uid: "m-1".into(),
            role,
            vmi_uid: "u1".into(),
            peer: "10.251.0.2:8444".into(),
            vmi: None,
            committed: false,
        }
    }

    #[test]
    fn marks_are_kept_whole_and_root_only() {
        use std::os::unix::fs::PermissionsExt;
        let t = tempfile::tempdir().unwrap();
        let marks = FileMarks::marks(t.path().join("migrations"));
        assert!(marks.get("ns_a").unwrap().is_none());
        marks.set("ns_a", &mark(Migrating::Outgoing)).unwrap();
        marks.set("ns_b", &mark(Migrating::Incoming)).unwrap();
        assert_eq!(marks.get("ns_a").unwrap(), Some(mark(Migrating::Outgoing)));
        let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&marks.dir), 0o700);
        assert_eq!(mode(&marks.dir.join("ns_a.json")), 0o600);
        let all: Vec<String> = marks.all().into_iter().map(|(id, _)| id).collect();
        assert_eq!(all, vec!["ns_a".to_string(), "ns_b".to_string()]);
        marks.clear("ns_a").unwrap();
        marks.clear("ns_a").unwrap();
        assert!(marks.get("ns_a").unwrap().is_none());
    }

    #[test]
    fn a_bad_mark_or_name_is_an_error_and_skipped() {
        let t = tempfile::tempdir().unwrap();
        let marks = FileMarks::marks(t.path().into());
        std::fs::write(t.path().join("ns_bad.json"), b"{\"role\": \"sideways\"}").unwrap();
        assert!(matches!(
            marks.get("ns_bad"),
            Err(MarkError::Invalid { .. })
        ));
        for id in ["../etc", "", ".hidden", "a/b"] {
            assert!(marks.set(id, &mark(Migrating::Outgoing)).is_err(), "{id:?}");
        }
        marks.set("ns_good", &mark(Migrating::Outgoing)).unwrap();
        let all: Vec<String> = marks.all().into_iter().map(|(id, _)| id).collect();
        assert_eq!(all, vec!["ns_good".to_string()]);
    }
}
