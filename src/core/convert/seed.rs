//! The data of a small read-only ISO the guest reads: cloud-init seeds and
//! configMap/secret/serviceAccount disks. Files come from the VMI itself
//! or, in cluster mode, from objects read when the VM starts; the image is
//! made by the runtime (ISO 9660 with Rock Ridge and Joliet names).

use crate::core::objects::{self, ObjectRef, Objects};

/// One seed image: its volume label and its files, by relative path.
#[derive(Clone, PartialEq, Eq)]
pub struct Seed {
    pub label: String,
    pub files: Vec<(String, Vec<u8>)>,
    /// Files still to be read from cluster objects.
    pub from_objects: Vec<ObjectFiles>,
    /// Holds data of a Secret or token: shown only as sizes.
    pub sensitive: bool,
}

/// Files a seed takes from one object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectFiles {
    pub object: ObjectRef,
    /// The VMI field that asked for it, for errors.
    pub field: String,
    pub take: Take,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Take {
    /// The first of these keys the object has, as `file`.
    FirstOf {
        keys: &'static [&'static str],
        file: String,
    },
    /// Every key as a file of its name. A missing optional object gives
    /// no files, as an optional pod volume is empty.
    All { optional: bool },
}

/// Files as text, so logs and snapshots read like the seed; a seed with
/// secret data shows sizes only.
impl std::fmt::Debug for Seed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let files: Vec<(&str, std::borrow::Cow<'_, str>)> = self
            .files
            .iter()
            .map(|(p, b)| {
                let text = if self.sensitive {
                    format!("<{} bytes>", b.len()).into()
                } else {
                    String::from_utf8_lossy(b)
                };
                (p.as_str(), text)
            })
            .collect();
        let mut d = f.debug_struct("Seed");
        d.field("label", &self.label).field("files", &files);
        if !self.from_objects.is_empty() {
            d.field("from_objects", &self.from_objects);
        }
        d.finish()
    }
}

impl Seed {
    pub fn new(label: impl Into<String>) -> Self {
        Seed {
            label: label.into(),
            files: Vec::new(),
            from_objects: Vec::new(),
            sensitive: false,
        }
    }

    /// The objects this seed still needs.
    pub fn object_refs(&self) -> impl Iterator<Item = &ObjectRef> {
        self.from_objects.iter().map(|o| &o.object)
    }

    /// The seed with the objects' data in its files (what the runtime
    /// writes). Errors name the field and the object.
    pub fn resolve(&self, objects: &Objects) -> Result<Seed, String> {
        let mut files = self.files.clone();
        let mut sensitive = self.sensitive;
        for o in &self.from_objects {
            let data = match (objects.get(&o.object), &o.take) {
                (Some(Some(d)), _) => d,
                (Some(None), Take::All { optional: true }) => continue,
                (Some(None), _) => return Err(format!("{}: {} not found", o.field, o.object)),
                (None, _) => return Err(format!("{}: {} was not read", o.field, o.object)),
            };
            sensitive |= !matches!(o.object, ObjectRef::ConfigMap(_));
            match &o.take {
                Take::FirstOf { keys, file } => {
                    let Some(v) = keys.iter().find_map(|k| data.get(*k)) else {
                        return Err(format!(
                            "{}: {} has no key {}",
                            o.field,
                            o.object,
                            keys.join(" or ")
                        ));
                    };
                    files.push((file.clone(), v.clone()));
                }
                Take::All { .. } => {
                    for (k, v) in data {
                        if !objects::is_file_name(k) {
                            return Err(format!(
                                "{}: {} has key {k:?}, which cannot be a file name",
                                o.field, o.object
                            ));
                        }
                        files.push((k.clone(), v.clone()));
                    }
                }
            }
        }
        Ok(Seed {
            label: self.label.clone(),
            files,
            from_objects: Vec::new(),
            sensitive,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::objects::ObjectData;

    fn data(pairs: &[(&str, &str)]) -> Option<ObjectData> {
        Some(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.as_bytes().to_vec()))
                .collect(),
        )
    }

    fn seed(take: Take, object: ObjectRef) -> Seed {
        let mut s = Seed::new("cidata");
        s.files.push(("meta-data".into(), b"m".to_vec()));
        s.from_objects.push(ObjectFiles {
            object,
            field: "spec.volumes[0].x".into(),
            take,
        });
        s
    }

    fn names(s: &Seed) -> Vec<&str> {
        s.files.iter().map(|(p, _)| p.as_str()).collect()
    }

    const USER: &[&str] = &["userdata", "userData"];

    #[test]
    fn first_key_found_becomes_the_file() {
        let s = seed(
            Take::FirstOf {
                keys: USER,
                file: "user-data".into(),
            },
            ObjectRef::Secret("s".into()),
        );
        let objs = Objects::from([(
            ObjectRef::Secret("s".into()),
            data(&[("userData", "b"), ("other", "x")]),
        )]);
        let r = s.resolve(&objs).unwrap();
        assert_eq!(names(&r), ["meta-data", "user-data"]);
        assert_eq!(r.files[1].1, b"b");
        assert!(r.from_objects.is_empty());
        let missing = Objects::from([(ObjectRef::Secret("s".into()), data(&[("x", "y")]))]);
        assert_eq!(
            s.resolve(&missing).unwrap_err(),
            "spec.volumes[0].x: secret \"s\" has no key userdata or userData"
        );
        let gone = Objects::from([(ObjectRef::Secret("s".into()), None)]);
        assert_eq!(
            s.resolve(&gone).unwrap_err(),
            "spec.volumes[0].x: secret \"s\" not found"
        );
    }

    #[test]
    fn all_keys_become_files_and_optional_objects_may_be_missing() {
        let cm = ObjectRef::ConfigMap("c".into());
        let s = seed(Take::All { optional: false }, cm.clone());
        let objs = Objects::from([(cm.clone(), data(&[("a.conf", "1"), ("b", "2")]))]);
        assert_eq!(
            names(&s.resolve(&objs).unwrap()),
            ["meta-data", "a.conf", "b"]
        );
        let gone = Objects::from([(cm.clone(), None)]);
        assert!(s.resolve(&gone).unwrap_err().contains("not found"));
        let opt = seed(Take::All { optional: true }, cm.clone());
        assert_eq!(names(&opt.resolve(&gone).unwrap()), ["meta-data"]);
        let bad = Objects::from([(cm, data(&[("../x", "1")]))]);
        assert!(s
            .resolve(&bad)
            .unwrap_err()
            .contains("cannot be a file name"));
    }

    #[test]
    fn secrets_never_show_in_debug_output() {
        let s = seed(Take::All { optional: false }, ObjectRef::Secret("s".into()));
        let objs = Objects::from([(ObjectRef::Secret("s".into()), data(&[("pw", "hunter2")]))]);
        let r = s.resolve(&objs).unwrap();
        assert!(!format!("{r:?}").contains("hunter2"), "{r:?}");
        assert!(
            format!("{r:?}").contains("(\"pw\", \"<7 bytes>\")"),
            "{r:?}"
        );
    }
}
