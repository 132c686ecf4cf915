//! Whose kept EFI variables (`efi.persistent`) are. KubeVirt keeps a VM's
//! NVRAM in backend storage owned by the VirtualMachine, so it outlives the
//! VM's VMIs and goes with the VM; kvirt keeps it in
//! `/var/lib/kvirt/efi-vars/<id>` under an owner written next to it.

use crate::core::key::VmKey;
use crate::core::vmi::VirtualMachineInstance;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Owner {
    /// The VMI's VirtualMachine, by uid: a VM deleted and made again under
    /// the same name is another owner, and starts from the template.
    VirtualMachine {
        namespace: String,
        name: String,
        uid: String,
    },
    /// A VMI without a VirtualMachine: the next VMI of its name.
    Vmi { namespace: String, name: String },
}

impl Owner {
    /// The VMI's VirtualMachine (from its ownerReferences), else the VMI.
    pub fn of(vmi: &VirtualMachineInstance, key: &VmKey) -> Self {
        let vm = vmi
            .metadata
            .owner_references
            .iter()
            .flatten()
            .find(|o| o.kind == "VirtualMachine" && o.api_version.starts_with("kubevirt.io/"));
        match vm {
            Some(o) => Owner::VirtualMachine {
                namespace: key.namespace().into(),
                name: o.name.clone(),
                uid: o.uid.clone(),
            },
            None => Owner::Vmi {
                namespace: key.namespace().into(),
                name: key.name().into(),
            },
        }
    }

    /// Reads what `Display` wrote; `None` for anything else (left alone).
    pub fn parse(s: &str) -> Option<Self> {
        let (kind, rest) = s.split_once(' ')?;
        let (object, uid) = match rest.split_once(' ') {
            Some((o, u)) => (o, Some(u)),
            None => (rest, None),
        };
        let (namespace, name) = object.split_once('/')?;
        let (namespace, name) = (namespace.to_owned(), name.to_owned());
        match (kind, uid) {
            ("VirtualMachine", Some(uid)) if !uid.is_empty() => Some(Owner::VirtualMachine {
                namespace,
                name,
                uid: uid.into(),
            }),
            ("VirtualMachineInstance", None) => Some(Owner::Vmi { namespace, name }),
            _ => None,
        }
    }
}

/// The owner file's text (kept variables of an owner with other text are
/// dropped, so this form stays as it is).
impl std::fmt::Display for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Owner::VirtualMachine {
                namespace,
                name,
                uid,
            } => write!(f, "VirtualMachine {namespace}/{name} {uid}"),
            Owner::Vmi { namespace, name } => {
                write!(f, "VirtualMachineInstance {namespace}/{name}")
            }
        }
    }
}

/// One VM's kept variables, as found on the host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kept {
    /// The VM id (`<ns>_<name>`) the directory is named for.
    pub id: String,
    /// `None` when the owner file is missing or unreadable.
    pub owner: Option<Owner>,
    /// A VM using them runs (or ran when kvirtd stopped).
    pub active: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vmi(yaml: &str) -> VirtualMachineInstance {
        VirtualMachineInstance::from_yaml(yaml).unwrap()
    }

    #[test]
    fn the_virtual_machine_owns_else_the_vmi() {
        let key = VmKey::new("ns", "vm-abc").unwrap();
        let owned = vmi("apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata:
  name: vm-abc
  namespace: ns
  ownerReferences:
  - {apiVersion: apps/v1, kind: VirtualMachine, name: other, uid: u0}
  - {apiVersion: kubevirt.io/v1, kind: VirtualMachine, name: vm, uid: u1}
");
        let o = Owner::of(&owned, &key);
        assert_eq!(
            o,
            Owner::VirtualMachine {
                namespace: "ns".into(),
                name: "vm".into(),
                uid: "u1".into()
            }
        );
        assert_eq!(o.to_string(), "VirtualMachine ns/vm u1");
        let bare = vmi(
            "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata: {name: vm-abc, namespace: ns}\n",
        );
        let o = Owner::of(&bare, &key);
        assert_eq!(o.to_string(), "VirtualMachineInstance ns/vm-abc");
        assert_eq!(Owner::parse(&o.to_string()), Some(o));
    }

    #[test]
    fn parse_reads_only_what_display_writes() {
        let vm = Owner::VirtualMachine {
            namespace: "ns".into(),
            name: "vm".into(),
            uid: "u1".into(),
        };
        assert_eq!(Owner::parse(&vm.to_string()), Some(vm));
        for bad in [
            "",
            "VirtualMachine ns/vm",
            "VirtualMachine ns/vm ",
            "VirtualMachineInstance ns/vm u1",
            "Pod ns/vm u1",
            "VirtualMachine vm u1",
        ] {
            assert_eq!(Owner::parse(bad), None, "{bad:?}");
        }
    }
}
