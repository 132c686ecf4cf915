//! `firmware.kernelBoot` → `<os>`'s `<kernel>`, `<initrd>`, `<cmdline>`.
//! The files come from a container image through the image cache and are
//! copied into the VM's own disk directory before the domain is defined.

use super::domain::Os;
use super::{DiskPrep, Errors, ImageFile};
use crate::core::layout::VmPaths;
use crate::core::vmi::KernelBoot;

/// Keys of the kernel and initrd in the pulled-images map: not DNS labels,
/// so never a volume's name.
pub const KERNEL: &str = "kernelBoot.kernel";
pub const INITRD: &str = "kernelBoot.initrd";

pub(super) fn convert(
    kb: &KernelBoot,
    paths: &VmPaths,
    cluster: bool,
    os: &mut Os,
    errs: &mut Errors,
) -> Option<DiskPrep> {
    const PATH: &str = "spec.domain.firmware.kernelBoot";
    errs.reject_extra(PATH, &kb.extra);
    let Some(c) = &kb.container else {
        errs.add(
            format!("{PATH}.container"),
            "is required: the kernel comes from a container image",
        );
        return None;
    };
    let p = format!("{PATH}.container");
    errs.reject_extra(&p, &c.extra);
    let before = errs.len();
    let pull_policy = super::disks::image_source(
        &c.image,
        c.image_pull_policy.as_deref(),
        c.image_pull_secret.as_deref(),
        cluster,
        &p,
        errs,
    );
    for (field, path) in [
        ("kernelPath", &c.kernel_path),
        ("initrdPath", &c.initrd_path),
    ] {
        if let Some(path) = path {
            if !path.starts_with('/')
                || path.chars().any(char::is_control)
                || path.split('/').any(|c| c == "..")
            {
                errs.add(
                    format!("{p}.{field}"),
                    format!("{path:?} is not an absolute path in the image"),
                );
            }
        }
    }
    if c.kernel_path.is_none() {
        errs.add(format!("{p}.kernelPath"), "is required");
    }
    if let Some(args) = &kb.kernel_args {
        if args.chars().any(char::is_control) {
            errs.add(format!("{PATH}.kernelArgs"), "must be one line");
        }
    }
    if errs.len() != before {
        return None;
    }
    let file = |from: &Option<String>, to: std::path::PathBuf| {
        from.as_ref().map(|from| ImageFile {
            path_in_image: from.clone(),
            dest: to,
        })
    };
    let kernel = file(&c.kernel_path, paths.kernel_file());
    let initrd = file(&c.initrd_path, paths.initrd_file());
    os.kernel = kernel.as_ref().map(|f| f.dest.display().to_string());
    os.initrd = initrd.as_ref().map(|f| f.dest.display().to_string());
    os.cmdline = kb.kernel_args.clone();
    Some(DiskPrep::KernelBoot {
        image: c.image.clone(),
        pull_policy: pull_policy?,
        pull_secret: c.image_pull_secret.clone(),
        kernel,
        initrd,
    })
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::super::{DiskPrep, DomainType};

    fn kb(spec: &str) -> Result<super::super::Converted, Vec<super::super::ConvertError>> {
        run(
            &vmi(&format!(
                "domain: {{memory: {{guest: 64Mi}}, firmware: {{kernelBoot: {spec}}}}}"
            )),
            DomainType::Qemu,
        )
    }

    #[test]
    fn kernel_and_initrd_from_an_image_into_the_vms_directory() {
        let c = kb("{kernelArgs: 'console=ttyS0 quiet', container: {image: 'registry:5000/k:1', kernelPath: /boot/vmlinuz, initrdPath: /boot/initrd.img}}").unwrap();
        let x = &c.domain_xml;
        for want in [
            "<kernel>/var/lib/kvirt/vms/ns_vm/disks/kernel</kernel>",
            "<initrd>/var/lib/kvirt/vms/ns_vm/disks/initrd</initrd>",
            "<cmdline>console=ttyS0 quiet</cmdline>",
        ] {
            assert!(x.contains(want), "{want} in {x}");
        }
        let DiskPrep::KernelBoot {
            image,
            kernel,
            initrd,
            ..
        } = &c.disks[0]
        else {
            panic!("{:?}", c.disks)
        };
        assert_eq!(image, "registry:5000/k:1");
        assert_eq!(kernel.as_ref().unwrap().path_in_image, "/boot/vmlinuz");
        assert_eq!(
            initrd.as_ref().unwrap().dest,
            std::path::Path::new("/var/lib/kvirt/vms/ns_vm/disks/initrd")
        );
    }

    #[test]
    fn errors() {
        assert_eq!(
            fields(kb("{kernelArgs: \"a\\nb\", container: {image: 'bad image', initrdPath: ../x, imagePullSecret: s, y: 1}}")),
            [
                "spec.domain.firmware.kernelBoot.container.y",
                "spec.domain.firmware.kernelBoot.container.image",
                "spec.domain.firmware.kernelBoot.container.imagePullSecret",
                "spec.domain.firmware.kernelBoot.container.initrdPath",
                "spec.domain.firmware.kernelBoot.container.kernelPath",
                "spec.domain.firmware.kernelBoot.kernelArgs",
            ]
        );
    }
}
