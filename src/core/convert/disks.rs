//! `devices.disks` + `volumes` → `<disk>`s, the SCSI controller they need,
//! and the files the runtime must prepare.

use super::cloudinit::{self, Flavor};
use super::configdisk;
use super::domain::{Alias, Boot, Controller, Disk, DiskDriver, DiskSource, DiskTarget, Present};
use super::downwardapi;
use super::{is_dns_label, is_dns_subdomain, Backing, ConvertContext, DiskPrep, Errors};
use crate::core::image::{self, PullPolicy};
use crate::core::pvc::{self, Backend};
use crate::core::vmi::{ContainerDisk, Ephemeral, HostDiskType, VmiSpec, Volume};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// qemu-img rounds virtual sizes up to whole sectors; doing it here makes
/// the raw files kvirt creates match and keeps sizes predictable.
const SECTOR: u64 = 512;

/// A volume resolved to a file (or a block device) on the host.
struct Source {
    path: PathBuf,
    format: &'static str,
    block: bool,
    /// The volume itself is read-only, whatever the disk says.
    readonly: bool,
}

impl Source {
    fn file(path: PathBuf, format: &'static str) -> Self {
        Self {
            path,
            format,
            block: false,
            readonly: false,
        }
    }
}

pub(super) fn convert(
    spec: &VmiSpec,
    meta: &ObjectMeta,
    ctx: &ConvertContext,
    uuid: &str,
    errs: &mut Errors,
) -> (Vec<Disk>, Vec<Controller>, Vec<DiskPrep>) {
    // KubeVirt's guest hostname: spec.hostname, else the VMI's name.
    let hostname = spec
        .extra
        .get("hostname")
        .and_then(|h| h.as_str())
        .unwrap_or(ctx.key.name());
    let (sources, preps) = volumes(&spec.volumes, meta, ctx, hostname, uuid, errs);
    let mut used = BTreeSet::new();
    let mut names = BTreeSet::new();
    let mut boot_orders = BTreeSet::new();
    let mut per_prefix: HashMap<&str, usize> = HashMap::new();
    let mut disks = Vec::new();
    let mut needs_scsi = false;

    for (i, d) in spec.domain.devices.disks.iter().enumerate() {
        let path = format!("spec.domain.devices.disks[{i}]");
        errs.reject_extra(&path, &d.extra);
        if !is_dns_label(&d.name) {
            errs.add(
                format!("{path}.name"),
                format!("{:?} is not a DNS-1123 label", d.name),
            );
        } else if !names.insert(d.name.as_str()) {
            errs.add(
                format!("{path}.name"),
                format!("disk {:?} is listed twice", d.name),
            );
        }
        let source = sources.get(d.name.as_str());
        if source.is_some() {
            used.insert(d.name.as_str());
        } else if !spec.volumes.iter().any(|v| v.name == d.name) {
            // A volume that exists but is broken has its own error already.
            errs.add(
                format!("{path}.name"),
                format!("no volume named {:?} in spec.volumes", d.name),
            );
        }

        let kinds = [d.disk.is_some(), d.cdrom.is_some(), d.lun.is_some()];
        if kinds.iter().filter(|&&k| k).count() > 1 {
            errs.add(&path, "set only one of disk, cdrom and lun");
        }
        if d.lun.is_some() {
            errs.add(
                format!("{path}.lun"),
                "LUN (SCSI passthrough) disks are not supported",
            );
        }
        let (device, bus, readonly, tray) = if let Some(c) = &d.cdrom {
            let p = format!("{path}.cdrom");
            errs.reject_extra(&p, &c.extra);
            let bus = match c.bus.as_deref().unwrap_or("sata") {
                "sata" => "sata",
                "scsi" => "scsi",
                other => {
                    errs.add(
                        format!("{p}.bus"),
                        format!("{other:?} is not supported for a cdrom (use sata or scsi)"),
                    );
                    "sata"
                }
            };
            if c.readonly == Some(false) {
                errs.add(format!("{p}.readonly"), "a cdrom is always read-only");
            }
            let tray = match c.tray.as_deref() {
                None | Some("closed") => None,
                Some("open") => Some("open"),
                Some(other) => {
                    errs.add(
                        format!("{p}.tray"),
                        format!("{other:?} is not open or closed"),
                    );
                    None
                }
            };
            ("cdrom", bus, true, tray)
        } else {
            // `defaults` gave a disk of no type its type and bus.
            let t = d.disk.clone().unwrap_or_default();
            let p = format!("{path}.disk");
            errs.reject_extra(&p, &t.extra);
            let bus = match t.bus.as_deref().unwrap_or(crate::core::defaults::DISK_BUS) {
                "virtio" => "virtio",
                "sata" => "sata",
                "scsi" => "scsi",
                other => {
                    errs.add(
                        format!("{p}.bus"),
                        format!("{other:?} is not supported (use virtio, sata or scsi)"),
                    );
                    "virtio"
                }
            };
            ("disk", bus, t.readonly == Some(true), None)
        };
        needs_scsi |= bus == "scsi";

        let boot = d.boot_order.map(|order| {
            if order == 0 {
                errs.add(format!("{path}.bootOrder"), "must be at least 1");
            } else if !boot_orders.insert(order) {
                errs.add(
                    format!("{path}.bootOrder"),
                    format!("{order} is used by another disk"),
                );
            }
            Boot { order }
        });
        if let Some(s) = &d.serial {
            if s.is_empty()
                || !s
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_.+-".contains(&b))
            {
                errs.add(
                    format!("{path}.serial"),
                    "may only contain letters, digits, '_', '.', '+' and '-'",
                );
            }
        }
        let cache = d.cache.as_deref().and_then(|c| match c {
            "none" => Some("none"),
            "writethrough" => Some("writethrough"),
            "writeback" => Some("writeback"),
            other => {
                errs.add(
                    format!("{path}.cache"),
                    format!("{other:?} is not none, writethrough or writeback"),
                );
                None
            }
        });
        let io = d.io.as_deref().and_then(|io| match io {
            // QEMU refuses native AIO on the host page cache.
            "native" if cache != Some("none") => {
                errs.add(format!("{path}.io"), "native needs cache: none");
                None
            }
            "native" => Some("native"),
            "threads" => Some("threads"),
            other => {
                errs.add(
                    format!("{path}.io"),
                    format!("{other:?} is not native or threads"),
                );
                None
            }
        });

        let shareable = d.shareable == Some(true);
        if shareable {
            // Two writers through a host page cache would corrupt it.
            if cache != Some("none") {
                errs.add(format!("{path}.shareable"), "needs cache: none");
            }
            if source.is_some_and(|s| s.format != "raw") {
                errs.add(
                    format!("{path}.shareable"),
                    "only a raw hostDisk can be shared (this volume is a VM's own qcow2)",
                );
            }
        }
        let prefix = if bus == "virtio" { "vd" } else { "sd" };
        let index = per_prefix.entry(prefix).or_default();
        let dev = format!("{prefix}{}", device_suffix(*index));
        *index += 1;

        if let Some(src) = source {
            let file = src.path.to_string_lossy().into_owned();
            disks.push(Disk {
                type_: if src.block { "block" } else { "file" },
                device,
                driver: DiskDriver {
                    name: "qemu",
                    type_: src.format,
                    cache,
                    io,
                },
                source: if src.block {
                    DiskSource {
                        file: None,
                        dev: Some(file),
                    }
                } else {
                    DiskSource {
                        file: Some(file),
                        dev: None,
                    }
                },
                target: DiskTarget { dev, bus, tray },
                serial: d.serial.clone(),
                boot,
                readonly: (readonly || src.readonly).then_some(Present {}),
                shareable: shareable.then_some(Present {}),
                // KubeVirt's user-alias convention: lets events and the
                // runtime map a libvirt device back to the VMI disk.
                alias: Alias {
                    name: format!("ua-{}", d.name),
                },
            });
        }
    }

    for (i, v) in spec.volumes.iter().enumerate() {
        if sources.contains_key(v.name.as_str()) && !used.contains(v.name.as_str()) {
            errs.add(
                format!("spec.volumes[{i}]"),
                format!("volume {:?} is not used by any disk", v.name),
            );
        }
    }
    let controllers = if needs_scsi {
        vec![Controller {
            type_: "scsi",
            index: 0,
            model: "virtio-scsi",
        }]
    } else {
        Vec::new()
    };
    (disks, controllers, preps)
}

/// `status.volumeStatus` as KubeVirt fills it for what kvirt has: each
/// disk's volume name and target device, and for a claim whose facts were
/// read, its `persistentVolumeClaimInfo`.
pub(super) fn volume_status(
    spec: &VmiSpec,
    disks: &[Disk],
    claims: &super::Claims,
) -> Vec<serde_json::Value> {
    disks
        .iter()
        .map(|d| {
            let name = d.alias.name.strip_prefix("ua-").unwrap_or(&d.alias.name);
            let mut s = serde_json::json!({"name": name, "target": d.target.dev});
            let claim = spec.volumes.iter().find(|v| v.name == name).and_then(|v| {
                let c = v.persistent_volume_claim.as_ref().map(|c| &c.claim_name);
                c.or(v.data_volume.as_ref().map(|d| &d.name))
            });
            if let Some(pvc) = claim.and_then(|c| claims.by_name.get(c)) {
                s["persistentVolumeClaimInfo"] = pvc.info(claims.filesystem_overhead);
            }
            s
        })
        .collect()
}

/// The volumes' check: what it needs of the VM, and what the volumes
/// checked so far hold together.
struct Volumes<'a, 'c> {
    ctx: &'a ConvertContext<'c>,
    who: Identity<'a>,
    preps: Vec<DiskPrep>,
    /// hostDisk files in use: one volume each.
    host_paths: BTreeSet<PathBuf>,
    cloud_init: bool,
    writable: DiskBudget,
}

/// Who the VM is, for the seeds that carry it.
struct Identity<'a> {
    meta: &'a ObjectMeta,
    hostname: &'a str,
    uuid: &'a str,
}

/// Checks every volume; returns the usable ones by name and their preps.
fn volumes<'v>(
    volumes: &'v [Volume],
    meta: &ObjectMeta,
    ctx: &ConvertContext,
    hostname: &str,
    uuid: &str,
    errs: &mut Errors,
) -> (BTreeMap<&'v str, Source>, Vec<DiskPrep>) {
    let who = Identity {
        meta,
        hostname,
        uuid,
    };
    let mut sources = BTreeMap::new();
    let mut check = Volumes {
        ctx,
        who,
        preps: Vec::new(),
        host_paths: BTreeSet::new(),
        cloud_init: false,
        writable: DiskBudget::new(ctx.limits.max_disk_bytes),
    };
    for (i, v) in volumes.iter().enumerate() {
        let path = format!("spec.volumes[{i}]");
        if !is_dns_label(&v.name) {
            errs.add(
                format!("{path}.name"),
                format!("{:?} is not a DNS-1123 label", v.name),
            );
            continue;
        }
        if sources.contains_key(v.name.as_str()) {
            errs.add(
                format!("{path}.name"),
                format!("volume {:?} is listed twice", v.name),
            );
            continue;
        }
        if let Some(source) = check.volume(v, &path, errs) {
            sources.insert(v.name.as_str(), source);
        }
    }
    (sources, check.preps)
}

impl Volumes<'_, '_> {
    /// One volume: its source checked, its prep recorded, the disk it gives.
    fn volume(&mut self, v: &Volume, path: &str, errs: &mut Errors) -> Option<Source> {
        let ctx = self.ctx;
        for k in v.extra.keys() {
            errs.add(
                format!("{path}.{k}"),
                "volume source not supported by kvirt",
            );
        }
        let set = [
            v.host_disk.is_some(),
            v.empty_disk.is_some(),
            v.cloud_init_no_cloud.is_some(),
            v.cloud_init_config_drive.is_some(),
            v.container_disk.is_some(),
            v.ephemeral.is_some(),
            v.config_map.is_some(),
            v.secret.is_some(),
            v.service_account.is_some(),
            v.downward_api.is_some(),
            v.persistent_volume_claim.is_some(),
            v.data_volume.is_some(),
        ]
        .into_iter()
        .filter(|s| *s)
        .count();
        if set > 1 {
            errs.add(path, "set only one volume source");
            return None;
        }
        let config_disk = v.config_map.is_some()
            || v.secret.is_some()
            || v.service_account.is_some()
            || v.downward_api.is_some();
        if let Some(cd) = &v.container_disk {
            let p = format!("{path}.containerDisk");
            let backing = container_disk(cd, &p, ctx.cluster, errs)?;
            return Some(self.overlay(v, backing));
        }
        if config_disk {
            return self.config_disk_volume(v, path, errs);
        }
        if v.persistent_volume_claim.is_some() || v.data_volume.is_some() {
            return self.claim_volume(v, path, errs);
        }
        if let Some(eph) = &v.ephemeral {
            let p = format!("{path}.ephemeral");
            let base = ephemeral(eph, ctx, &p, errs)?;
            if !self.host_paths.insert(base.clone()) {
                errs.add(format!("{p}.hostDisk.path"), "used by another volume");
            }
            return Some(self.overlay(v, Backing::HostDisk(base)));
        }
        let cloud_init = match (&v.cloud_init_no_cloud, &v.cloud_init_config_drive) {
            (Some(ci), _) => Some((Flavor::NoCloud, ci)),
            (_, Some(ci)) => Some((Flavor::ConfigDrive, ci)),
            _ => None,
        };
        match (&v.host_disk, &v.empty_disk, cloud_init) {
            (None, None, None) => {
                if v.extra.is_empty() {
                    errs.add(path, "has no volume source");
                }
                None
            }
            (_, _, Some((flavor, ci))) => {
                let p = format!("{path}.{}", flavor.field());
                self.cloud_init_volume(v, (flavor, ci), &p, errs)
            }
            (Some(hd), _, None) => self.host_disk_volume(v, hd, path, errs),
            (None, Some(ed), None) => {
                let p = format!("{path}.emptyDisk");
                errs.reject_extra(&p, &ed.extra);
                let file = ctx.paths.empty_disk(&v.name);
                let field = format!("{p}.capacity");
                if let Some(size_bytes) = capacity(&ed.capacity, &field, errs) {
                    self.writable.charge(size_bytes, &field, errs);
                    self.preps.push(DiskPrep::CreateQcow2 {
                        volume: v.name.clone(),
                        path: file.clone(),
                        size_bytes,
                    });
                }
                Some(qcow2(file))
            }
        }
    }

    /// The one cloud-init volume a VM may have: a seed ISO.
    fn cloud_init_volume(
        &mut self,
        v: &Volume,
        (flavor, ci): (Flavor, &crate::core::vmi::CloudInit),
        p: &str,
        errs: &mut Errors,
    ) -> Option<Source> {
        let ctx = self.ctx;
        if self.cloud_init {
            errs.add(p, "only one cloud-init volume is allowed");
            return None;
        }
        self.cloud_init = true;
        let seed = cloudinit::seed(
            flavor,
            ci,
            p,
            ctx.key,
            self.who.hostname,
            self.who.uuid,
            ctx.cluster,
            errs,
        )?;
        Some(self.seed_iso(v, ctx.paths.cloud_init_iso(&v.name), seed))
    }

    /// A fresh qcow2 overlay over `backing`, made on every start.
    fn overlay(&mut self, v: &Volume, backing: Backing) -> Source {
        let file = self.ctx.paths.overlay(&v.name);
        self.preps.push(DiskPrep::Overlay {
            volume: v.name.clone(),
            path: file.clone(),
            backing,
        });
        qcow2(file)
    }

    /// An ISO made from `seed` at `file`.
    fn seed_iso(&mut self, v: &Volume, file: PathBuf, seed: super::seed::Seed) -> Source {
        self.preps.push(DiskPrep::SeedIso {
            volume: v.name.clone(),
            path: file.clone(),
            seed,
        });
        Source::file(file, "raw")
    }

    /// configMap, secret, serviceAccount and downwardAPI volumes: a seed ISO.
    fn config_disk_volume(&mut self, v: &Volume, path: &str, errs: &mut Errors) -> Option<Source> {
        let seed = match &v.downward_api {
            Some(d) => downwardapi::seed(d, self.who.meta, path, errs),
            None => configdisk::seed(v, path, self.ctx.cluster, errs),
        }?;
        Some(self.seed_iso(v, self.ctx.paths.config_iso(&v.name), seed))
    }

    /// A `persistentVolumeClaim` or `dataVolume`: KubeVirt's `disk.img` in
    /// a filesystem claim's root, or a block claim's device.
    fn claim_volume(&mut self, v: &Volume, path: &str, errs: &mut Errors) -> Option<Source> {
        let ctx = self.ctx;
        let (claim, asked_ro, hotplug, p) = match (&v.persistent_volume_claim, &v.data_volume) {
            (Some(c), _) => {
                let p = format!("{path}.persistentVolumeClaim");
                errs.reject_extra(&p, &c.extra);
                (&c.claim_name, c.read_only == Some(true), c.hotpluggable, p)
            }
            (None, Some(d)) => {
                let p = format!("{path}.dataVolume");
                errs.reject_extra(&p, &d.extra);
                if !ctx.cluster {
                    errs.add(&p, "DataVolumes need a cluster (CDI populates them)");
                }
                (&d.name, false, d.hotpluggable, p)
            }
            (None, None) => return None,
        };
        if hotplug == Some(true) {
            errs.add(format!("{p}.hotpluggable"), "kvirt has no volume hotplug");
        }
        if !is_dns_subdomain(claim) {
            errs.add(&p, format!("{claim:?} is not a claim name"));
            return None;
        }
        let Some(pvc) = ctx.claims.by_name.get(claim) else {
            if ctx.claims.complete {
                let known: Vec<&str> = ctx.claims.by_name.keys().map(String::as_str).collect();
                errs.add(
                    &p,
                    format!(
                        "claim {claim:?} is not configured on this host ([storage.claims]: {})",
                        if known.is_empty() {
                            "none".to_owned()
                        } else {
                            known.join(", ")
                        }
                    ),
                );
                return None;
            }
            // Not read in this pass: the VM does not start from it.
            return Some(Source::file(
                PathBuf::from(format!("/dev/null/{claim}")),
                "raw",
            ));
        };
        let readonly = asked_ro || pvc.read_only;
        match &pvc.backend {
            Backend::Directory { root, dir } => {
                let file = dir.join(pvc::DISK_IMG);
                if !self.host_paths.insert(file.clone()) {
                    errs.add(&p, format!("claim {claim:?} is used by another volume"));
                }
                let size_bytes = if readonly {
                    None
                } else {
                    match pvc.disk_bytes(ctx.claims.filesystem_overhead) {
                        Ok(b) => Some(b),
                        Err(e) => {
                            errs.add(&p, e);
                            return None;
                        }
                    }
                };
                self.preps.push(DiskPrep::Claim {
                    volume: v.name.clone(),
                    root: root.clone(),
                    path: file.clone(),
                    size_bytes,
                });
                Some(Source {
                    readonly,
                    ..Source::file(file, "raw")
                })
            }
            Backend::Block(device) => {
                if !self.host_paths.insert(device.clone()) {
                    errs.add(&p, format!("claim {claim:?} is used by another volume"));
                }
                let node = ctx.paths.claim_device(&v.name);
                self.preps.push(DiskPrep::ClaimDevice {
                    volume: v.name.clone(),
                    device: device.clone(),
                    node: node.clone(),
                    read_only: readonly,
                });
                Some(Source {
                    path: node,
                    format: "raw",
                    block: true,
                    readonly,
                })
            }
        }
    }

    /// A hostDisk: an existing file, or one made if missing (DiskOrCreate).
    fn host_disk_volume(
        &mut self,
        v: &Volume,
        hd: &crate::core::vmi::HostDisk,
        path: &str,
        errs: &mut Errors,
    ) -> Option<Source> {
        let p = format!("{path}.hostDisk");
        errs.reject_extra(&p, &hd.extra);
        let file = host_disk_path(&hd.path, self.ctx, &format!("{p}.path"), errs)?;
        if !self.host_paths.insert(file.clone()) {
            errs.add(format!("{p}.path"), "used by another volume");
        }
        match (hd.type_, &hd.capacity) {
            (HostDiskType::Disk, Some(_)) => errs.add(
                format!("{p}.capacity"),
                "only allowed with type DiskOrCreate",
            ),
            (HostDiskType::Disk, None) => self.preps.push(DiskPrep::RequireExisting {
                volume: v.name.clone(),
                path: file.clone(),
            }),
            (HostDiskType::DiskOrCreate, None) => {
                errs.add(format!("{p}.capacity"), "required with type DiskOrCreate")
            }
            (HostDiskType::DiskOrCreate, Some(q)) => {
                let field = format!("{p}.capacity");
                if let Some(size_bytes) = capacity(q, &field, errs) {
                    self.writable.charge(size_bytes, &field, errs);
                    self.preps.push(DiskPrep::CreateRawIfMissing {
                        volume: v.name.clone(),
                        path: file.clone(),
                        size_bytes,
                    });
                }
            }
        }
        Some(Source::file(file, "raw"))
    }
}

fn qcow2(path: PathBuf) -> Source {
    Source::file(path, "qcow2")
}

fn container_disk(
    cd: &ContainerDisk,
    p: &str,
    cluster: bool,
    errs: &mut Errors,
) -> Option<Backing> {
    errs.reject_extra(p, &cd.extra);
    let before = errs.len();
    let pull_policy = image_source(
        &cd.image,
        cd.image_pull_policy.as_deref(),
        cd.image_pull_secret.as_deref(),
        cluster,
        p,
        errs,
    );
    if let Some(path) = &cd.path {
        if path.is_empty()
            || path.chars().any(char::is_control)
            || path.split('/').any(|c| c == "..")
        {
            errs.add(
                format!("{p}.path"),
                format!("{path:?} is not a path in the image"),
            );
        }
    }
    (errs.len() == before).then(|| Backing::Image {
        image: cd.image.clone(),
        pull_policy: pull_policy.expect("checked above"),
        pull_secret: cd.image_pull_secret.clone(),
        path: cd.path.clone(),
    })
}

/// What containerDisks and kernelBoot share: the image reference, its pull
/// policy (`None` when it is wrong), and registry credentials from a
/// Secret, which only a cluster has.
pub(super) fn image_source(
    image: &str,
    policy: Option<&str>,
    pull_secret: Option<&str>,
    cluster: bool,
    p: &str,
    errs: &mut Errors,
) -> Option<PullPolicy> {
    if let Err(e) = image::parse_reference(image) {
        errs.add(format!("{p}.image"), e);
    }
    let resolved = PullPolicy::resolve(policy, image);
    if let (Err(e), Some(_)) = (&resolved, policy) {
        errs.add(format!("{p}.imagePullPolicy"), e);
    }
    match pull_secret {
        Some(_) if !cluster => errs.add(format!("{p}.imagePullSecret"), super::NEEDS_CLUSTER),
        Some("") => errs.add(format!("{p}.imagePullSecret"), "must name a Secret"),
        _ => {}
    }
    resolved.ok()
}

fn ephemeral(eph: &Ephemeral, ctx: &ConvertContext, p: &str, errs: &mut Errors) -> Option<PathBuf> {
    for k in eph.extra.keys() {
        let why = if k == "persistentVolumeClaim" {
            "PVCs need a cluster's storage: kvirt layers ephemeral disks over a hostDisk"
        } else {
            "not supported by kvirt"
        };
        errs.add(format!("{p}.{k}"), why);
    }
    let Some(hd) = &eph.host_disk else {
        if eph.extra.is_empty() {
            errs.add(p, "needs a hostDisk to lay the overlay over");
        }
        return None;
    };
    let p = format!("{p}.hostDisk");
    errs.reject_extra(&p, &hd.extra);
    if hd.type_ != HostDiskType::Disk {
        errs.add(format!("{p}.type"), "must be Disk: the base is only read");
    }
    if hd.capacity.is_some() {
        errs.add(format!("{p}.capacity"), "the overlay has the base's size");
    }
    host_disk_path(&hd.path, ctx, &format!("{p}.path"), errs)
}

/// What the VM's own writable disks may grow to together: a guest fills
/// what it is given, so a VMI asking for more than the host allows one VM
/// is refused, with both figures, at the disk that crosses the line.
struct DiskBudget {
    max: u64,
    used: u64,
}

impl DiskBudget {
    fn new(max: u64) -> Self {
        Self { max, used: 0 }
    }

    fn charge(&mut self, bytes: u64, field: &str, errs: &mut Errors) {
        let before = self.used;
        self.used = self.used.saturating_add(bytes);
        if before <= self.max && self.used > self.max {
            let gib = |b: u64| format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64);
            errs.add(
                field,
                format!(
                    "brings the VM's writable disks (emptyDisks and DiskOrCreate hostDisks) \
                     to {}, more than this host allows one VM ({}, vm.max_disk_size)",
                    gib(self.used),
                    gib(self.max)
                ),
            );
        }
    }
}

fn capacity(q: &crate::core::quantity::Quantity, field: &str, errs: &mut Errors) -> Option<u64> {
    match q.to_bytes() {
        Ok(0) => errs.add(field, "must be greater than zero"),
        Ok(b) => match b.checked_next_multiple_of(SECTOR) {
            Some(b) => return Some(b),
            None => errs.add(field, "is too large"),
        },
        Err(e) => errs.add(field, e),
    }
    None
}

/// Only lexical checks: the converter does no I/O. The runtime resolves
/// symlinks and checks again before using the file.
fn host_disk_path(
    raw: &str,
    ctx: &ConvertContext,
    field: &str,
    errs: &mut Errors,
) -> Option<PathBuf> {
    let problem = if !raw.starts_with('/') {
        Some("must be an absolute path".to_owned())
    } else if raw.chars().any(char::is_control) {
        Some("must not contain control characters".to_owned())
    } else if raw.ends_with('/')
        || raw[1..]
            .split('/')
            .any(|c| c.is_empty() || c == "." || c == "..")
    {
        Some(format!(
            "{raw:?} must be a normalised path (no '.', '..', '//' or trailing '/')"
        ))
    } else if !ctx
        .host_disk_roots
        .iter()
        .any(|root| Path::new(raw).starts_with(root) && Path::new(raw) != root)
    {
        Some(format!(
            "{raw:?} is not under an allowed hostDisk root ({})",
            if ctx.host_disk_roots.is_empty() && ctx.cluster {
                format!(
                    "none are granted to namespace {} (storage.host_disk_roots_by_namespace)",
                    ctx.key.namespace()
                )
            } else if ctx.host_disk_roots.is_empty() {
                "none are configured".to_owned()
            } else {
                ctx.host_disk_roots
                    .iter()
                    .map(|r| r.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        ))
    } else {
        None
    };
    match problem {
        Some(p) => {
            errs.add(field, p);
            None
        }
        None => Some(PathBuf::from(raw)),
    }
}

/// `a`..`z`, `aa`..`zz`, ... like the kernel names disks.
fn device_suffix(mut i: usize) -> String {
    let mut s = Vec::new();
    loop {
        s.push(b'a' + (i % 26) as u8);
        if i < 26 {
            break;
        }
        i = i / 26 - 1;
    }
    s.reverse();
    String::from_utf8(s).expect("ASCII")
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::super::{DiskPrep, DomainType};
    use super::*;

    const MIXED: &str = "domain:
  memory: {guest: 64Mi}
  devices:
    disks:
      - {name: root, disk: {bus: virtio}, bootOrder: 1, serial: ROOT-1, cache: none, io: native, shareable: true}
      - {name: data, disk: {bus: sata, readonly: true}}
      - {name: fast, disk: {bus: scsi}}
      - {name: iso, cdrom: {bus: sata}, bootOrder: 2}
      - {name: scratch}
volumes:
  - {name: root, hostDisk: {path: /srv/vms/root.img, type: Disk}}
  - {name: data, hostDisk: {path: /srv/vms/data.img, type: DiskOrCreate, capacity: 1000}}
  - {name: fast, emptyDisk: {capacity: 1Gi}}
  - {name: iso, hostDisk: {path: /srv/vms/boot.iso, type: Disk}}
  - {name: scratch, emptyDisk: {capacity: 2Gi}}";

    #[test]
    fn names_buses_and_preps() {
        let c = run(&vmi(MIXED), DomainType::Kvm).unwrap();
        let x = &c.domain_xml;
        for want in [
            r#"<target dev="vda" bus="virtio"/>"#,
            r#"<target dev="sda" bus="sata"/>"#,
            r#"<target dev="sdb" bus="scsi"/>"#,
            r#"<target dev="sdc" bus="sata"/>"#,
            // A disk without a bus is SATA, as KubeVirt defaults it on amd64.
            r#"<target dev="sdd" bus="sata"/>"#,
            r#"<driver name="qemu" type="raw" cache="none" io="native"/>"#,
            r#"<source file="/var/lib/kvirt/vms/ns_vm/disks/fast.qcow2"/>"#,
            r#"<controller type="scsi" index="0" model="virtio-scsi"/>"#,
            r#"<disk type="file" device="cdrom">"#,
            "<serial>ROOT-1</serial>",
            r#"<boot order="2"/>"#,
            r#"<alias name="ua-scratch"/>"#,
            "<shareable/>",
        ] {
            assert!(x.contains(want), "{want} missing in\n{x}");
        }
        assert_eq!(x.matches("<readonly/>").count(), 2);
        assert_eq!(
            c.disks,
            [
                DiskPrep::RequireExisting {
                    volume: "root".into(),
                    path: "/srv/vms/root.img".into()
                },
                DiskPrep::CreateRawIfMissing {
                    volume: "data".into(),
                    path: "/srv/vms/data.img".into(),
                    size_bytes: 1024
                },
                DiskPrep::CreateQcow2 {
                    volume: "fast".into(),
                    path: "/var/lib/kvirt/vms/ns_vm/disks/fast.qcow2".into(),
                    size_bytes: 1 << 30
                },
                DiskPrep::RequireExisting {
                    volume: "iso".into(),
                    path: "/srv/vms/boot.iso".into()
                },
                DiskPrep::CreateQcow2 {
                    volume: "scratch".into(),
                    path: "/var/lib/kvirt/vms/ns_vm/disks/scratch.qcow2".into(),
                    size_bytes: 2 << 30
                },
            ]
        );
    }

    #[test]
    fn suffixes() {
        let s: Vec<String> = [0, 1, 25, 26, 27, 51, 52, 701, 702]
            .map(device_suffix)
            .into();
        assert_eq!(s, ["a", "b", "z", "aa", "ab", "az", "ba", "zz", "aaa"]);
    }

    fn disk_errors(disks: &str, volumes: &str) -> Vec<String> {
        fields(run(
            &vmi(&format!("domain: {{memory: {{guest: 64Mi}}, devices: {{disks: {disks}}}}}\nvolumes: {volumes}")),
            DomainType::Kvm,
        ))
    }

    #[test]
    fn writable_disks_beyond_the_hosts_limit_are_refused_with_the_figures() {
        // The default limit is 1 TiB per VM: 512 GiB twice fits, a third
        // crosses it (and only that one is named), 50 TiB alone crosses it.
        let two = vmi("domain: {memory: {guest: 64Mi}, devices: {disks: [{name: a}, {name: b}]}}\nvolumes: [{name: a, emptyDisk: {capacity: 512Gi}}, {name: b, hostDisk: {path: /srv/vms/b, type: DiskOrCreate, capacity: 512Gi}}]");
        assert!(run(&two, DomainType::Kvm).is_ok());
        let three = disk_errors(
            "[{name: a}, {name: b}, {name: c}]",
            "[{name: a, emptyDisk: {capacity: 512Gi}}, {name: b, emptyDisk: {capacity: 512Gi}}, {name: c, emptyDisk: {capacity: 1Mi}}, ]",
        );
        assert_eq!(three, ["spec.volumes[2].emptyDisk.capacity"]);
        let huge = vmi("domain: {memory: {guest: 64Mi}, devices: {disks: [{name: a}]}}\nvolumes: [{name: a, emptyDisk: {capacity: 50Ti}}]");
        let e = run(&huge, DomainType::Kvm)
            .expect_err("50 TiB")
            .remove(0)
            .to_string();
        assert!(
            e.contains("spec.volumes[0].emptyDisk.capacity")
                && e.contains("51200.0 GiB")
                && e.contains("1024.0 GiB")
                && e.contains("vm.max_disk_size"),
            "{e}"
        );
    }

    #[test]
    fn host_disk_paths() {
        for bad in [
            "srv/vms/a",
            "/srv/vms/../etc/shadow",
            "/srv/vms/./a",
            "/srv/vms//a",
            "/srv/vms",
            "/srv/vmsx/a",
            "/etc/a",
            "/srv/vms/a/",
        ] {
            let f = disk_errors(
                "[{name: a}]",
                &format!("[{{name: a, hostDisk: {{path: \"{bad}\", type: Disk}}}}]"),
            );
            assert_eq!(f, ["spec.volumes[0].hostDisk.path"], "{bad}");
        }
    }

    #[test]
    fn errors() {
        assert_eq!(
            disk_errors(
                "[{name: a}, {name: b, lun: {}}]",
                "[{name: a, emptyDisk: {capacity: 1Gi}}, {name: b, emptyDisk: {capacity: 1Gi}}]"
            ),
            ["spec.domain.devices.disks[1].lun"]
        );
        assert_eq!(
            disk_errors(
                "[{name: a}, {name: b}]",
                "[{name: a, emptyDisk: {capacity: 1Gi}}, {name: c, emptyDisk: {capacity: 1Gi}}]"
            ),
            // Volume c gets a disk of its own, as in KubeVirt.
            ["spec.domain.devices.disks[1].name"]
        );
        assert_eq!(
            disk_errors(
                "[{name: a, cdrom: {bus: virtio, readonly: false, tray: half}}]",
                "[{name: a, hostDisk: {path: /srv/vms/a, type: DiskOrCreate}}]"
            ),
            [
                "spec.volumes[0].hostDisk.capacity",
                "spec.domain.devices.disks[0].cdrom.bus",
                "spec.domain.devices.disks[0].cdrom.readonly",
                "spec.domain.devices.disks[0].cdrom.tray"
            ]
        );
        assert_eq!(
            disk_errors(
                "[{name: a, bootOrder: 1, io: native, cache: bogus, serial: \"a b\", shareable: true}, {name: B, bootOrder: 1, disk: {bus: usb}}]",
                "[{name: a, emptyDisk: {capacity: 0}}, {name: b, hostDisk: {path: /srv/vms/a, type: Disk, capacity: 1Gi}}]"
            ),
            [
                "spec.volumes[0].emptyDisk.capacity",
                "spec.volumes[1].hostDisk.capacity",
                "spec.domain.devices.disks[0].serial",
                "spec.domain.devices.disks[0].cache",
                "spec.domain.devices.disks[0].io",
                "spec.domain.devices.disks[0].shareable",
                "spec.domain.devices.disks[0].shareable",
                "spec.domain.devices.disks[1].name",
                "spec.domain.devices.disks[1].name",
                "spec.domain.devices.disks[1].disk.bus",
                "spec.domain.devices.disks[1].bootOrder"
            ]
        );
    }

    #[test]
    fn container_disks_and_ephemeral_volumes_are_overlays() {
        let c = run(
            &vmi("domain:
  memory: {guest: 64Mi}
  devices: {disks: [{name: root, bootOrder: 1}, {name: data, disk: {bus: sata}}]}
volumes:
  - {name: root, containerDisk: {image: 'quay.io/containerdisks/fedora:41', path: /disk/f.qcow2}}
  - {name: data, ephemeral: {hostDisk: {path: /srv/vms/base.img, type: Disk}}}"),
            DomainType::Kvm,
        )
        .unwrap();
        let x = &c.domain_xml;
        for want in [
            r#"<source file="/var/lib/kvirt/vms/ns_vm/disks/root.overlay.qcow2"/>"#,
            r#"<source file="/var/lib/kvirt/vms/ns_vm/disks/data.overlay.qcow2"/>"#,
        ] {
            assert!(x.contains(want), "{want} missing in\n{x}");
        }
        assert_eq!(
            x.matches(r#"<driver name="qemu" type="qcow2"/>"#).count(),
            2
        );
        assert_eq!(
            c.disks,
            [
                DiskPrep::Overlay {
                    volume: "root".into(),
                    path: "/var/lib/kvirt/vms/ns_vm/disks/root.overlay.qcow2".into(),
                    backing: Backing::Image {
                        image: "quay.io/containerdisks/fedora:41".into(),
                        pull_policy: PullPolicy::IfNotPresent,
                        pull_secret: None,
                        path: Some("/disk/f.qcow2".into()),
                    },
                },
                DiskPrep::Overlay {
                    volume: "data".into(),
                    path: "/var/lib/kvirt/vms/ns_vm/disks/data.overlay.qcow2".into(),
                    backing: Backing::HostDisk("/srv/vms/base.img".into()),
                },
            ]
        );
    }

    #[test]
    fn container_disk_and_ephemeral_errors() {
        assert_eq!(
            disk_errors(
                "[{name: a}, {name: b}, {name: c}, {name: d}]",
                "[{name: a, containerDisk: {image: 'bad image', imagePullPolicy: Sometimes, imagePullSecret: s, path: ../x, size: 1}},
                  {name: b, ephemeral: {persistentVolumeClaim: {claimName: pvc}}},
                  {name: c, ephemeral: {hostDisk: {path: /etc/passwd, type: DiskOrCreate, capacity: 1Gi}}},
                  {name: d, ephemeral: {}}]"
            ),
            [
                "spec.volumes[0].containerDisk.size",
                "spec.volumes[0].containerDisk.image",
                "spec.volumes[0].containerDisk.imagePullPolicy",
                "spec.volumes[0].containerDisk.imagePullSecret",
                "spec.volumes[0].containerDisk.path",
                "spec.volumes[1].ephemeral.persistentVolumeClaim",
                "spec.volumes[2].ephemeral.hostDisk.type",
                "spec.volumes[2].ephemeral.hostDisk.capacity",
                "spec.volumes[2].ephemeral.hostDisk.path",
                "spec.volumes[3].ephemeral",
            ]
        );
        // Two sources in one volume, and the same base twice.
        assert_eq!(
            disk_errors(
                "[{name: a}, {name: b}]",
                "[{name: a, containerDisk: {image: x}, emptyDisk: {capacity: 1Gi}},
                  {name: b, ephemeral: {hostDisk: {path: /srv/vms/x, type: Disk}}, hostDisk: {path: /srv/vms/x, type: Disk}}]"
            ),
            ["spec.volumes[0]", "spec.volumes[1]"]
        );
    }
}
