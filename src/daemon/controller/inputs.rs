//! What a start needs from outside before anything is made on the host:
//! the cluster objects its seed disks carry and the images it boots. While
//! they are missing the VMI waits, with the reason in its Ready condition.

use super::{now_rfc3339, Adapters, Controller, ControllerError};
use crate::core::cni::{self, ConfList, NetworkRef};
use crate::core::convert::{Converted, DiskPrep};
use crate::core::key::VmKey;
use crate::core::objects::{ObjectRef, Objects, NAD_CONFIG, NAD_RESOURCE};
use crate::core::pullsecret::{self, Credentials};
use crate::core::quota;
use crate::core::status;
use crate::core::vmi::VirtualMachineInstance;
use crate::host::bridging::Attached;
use crate::host::image::{ImageDisk, ImageError, Images, Progress};
use crate::host::network::Network;
use crate::sources::cluster::FINALIZER;
use crate::sources::{EventReason, Recorder, SourceError, StatusStore};
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::Duration;
use tracing::{info, warn};

impl<A: Adapters> Controller<A> {
    /// The Secrets, ConfigMaps and ServiceAccount tokens the seed images
    /// name are read once per start, before anything is made on the host;
    /// the disks come back with their data. A missing object is waited for
    /// (backoff, `Ready=False FailedMount`, an Event), as kubelet waits to
    /// mount a pod's volume; a running VM never rereads them.
    pub(super) async fn read_objects(
        &self,
        vmi: &VirtualMachineInstance,
        key: &VmKey,
        conv: &Converted,
    ) -> Result<Vec<DiskPrep>, ControllerError> {
        let mut objects = Objects::new();
        let refs = conv.disks.iter().flat_map(|d| match d {
            DiskPrep::SeedIso { seed, .. } => seed.object_refs().collect(),
            _ => Vec::new(),
        });
        let mut result = Ok(());
        let mut reason = EventReason::FailedMount;
        for r in refs {
            if objects.contains_key(r) {
                continue;
            }
            match self.deps.status.object(key.namespace(), r).await {
                Ok(data) => {
                    objects.insert(r.clone(), data);
                }
                Err(e) => {
                    if matches!(e, SourceError::NotOptedIn { .. }) {
                        reason = EventReason::NamespaceNotOptedIn;
                    }
                    result = Err(e.to_string());
                    break;
                }
            }
        }
        let disks = result.and_then(|()| {
            conv.disks
                .iter()
                .map(|d| match d {
                    DiskPrep::SeedIso { volume, path, seed } if !seed.from_objects.is_empty() => {
                        Ok(DiskPrep::SeedIso {
                            volume: volume.clone(),
                            path: path.clone(),
                            seed: seed.resolve(&objects)?,
                        })
                    }
                    other => Ok(other.clone()),
                })
                .collect::<Result<Vec<_>, String>>()
        });
        match disks {
            Ok(d) => Ok(d),
            Err(message) => {
                self.wait_for(vmi, key, reason, &message).await;
                Err(ControllerError::Objects {
                    id: key.id(),
                    message,
                })
            }
        }
    }

    /// The NetworkAttachmentDefinitions of the secondary networks, read
    /// once per start and resolved as Multus does. One that is missing,
    /// unusable, or another namespace's that this one may not use is
    /// waited for (`Ready=False`, an Event), as a pod waits for Multus; a
    /// running VM never rereads them (DEL uses what ADD was given).
    pub(super) async fn read_networks(
        &self,
        vmi: &VirtualMachineInstance,
        key: &VmKey,
        conv: &Converted,
    ) -> Result<Vec<Attached>, ControllerError> {
        let mut out = Vec::new();
        for s in &conv.secondary_networks {
            match self.network_config(key, &s.network).await {
                Ok(list) => out.push(Attached {
                    secondary: s.clone(),
                    list,
                }),
                Err((reason, message)) => {
                    self.wait_for(vmi, key, reason, &message).await;
                    return Err(ControllerError::Objects {
                        id: key.id(),
                        message,
                    });
                }
            }
        }
        Ok(out)
    }

    async fn network_config(
        &self,
        key: &VmKey,
        r: &NetworkRef,
    ) -> Result<ConfList, (EventReason, String)> {
        let sandbox = |m: String| (EventReason::FailedCreatePodSandBox, m);
        if r.namespace != key.namespace()
            && !self.settings.cni_global_namespaces.contains(&r.namespace)
        {
            return Err(sandbox(format!(
                "network {r}: a network of another namespace may be used only from \
                 network.cni_global_namespaces ({:?})",
                self.settings.cni_global_namespaces
            )));
        }
        let object = ObjectRef::NetworkAttachmentDefinition(r.name.clone());
        let data = match self.deps.status.object(&r.namespace, &object).await {
            Ok(Some(d)) => d,
            Ok(None) => {
                return Err(sandbox(format!(
                    "network-attachment-definition {r} not found"
                )))
            }
            Err(e @ SourceError::NotOptedIn { .. }) => {
                return Err((EventReason::NamespaceNotOptedIn, e.to_string()))
            }
            Err(e) => return Err(sandbox(e.to_string())),
        };
        if let Some(res) = data.get(NAD_RESOURCE) {
            return Err(sandbox(format!(
                "network {r}: device resource {:?} (SR-IOV and other device plugins) is not supported by kvirt",
                String::from_utf8_lossy(res)
            )));
        }
        let config = data
            .get(NAD_CONFIG)
            .map(|c| String::from_utf8_lossy(c).into_owned())
            .unwrap_or_default();
        let config = if config.trim().is_empty() {
            self.deps.network.named_config(&r.name).ok_or_else(|| {
                sandbox(format!(
                    "network {r}: no spec.config, and no CNI config file names a network {:?}",
                    r.name
                ))
            })?
        } else {
            config
        };
        cni::resolve(&r.name, &config).map_err(|e| sandbox(e.to_string()))
    }

    /// A VMI's emptyDisks must fit its namespace's ResourceQuotas
    /// (`ephemeral-storage`) before kvirt takes it on (holds it, makes
    /// anything). Until they do, it waits, as a pod's creation is refused
    /// until quota frees; once taken, a quota lowered never stops it.
    pub(super) async fn fit_allowance(
        &self,
        vmi: &VirtualMachineInstance,
        key: &VmKey,
    ) -> Result<(), ControllerError> {
        let uid = vmi.uid().unwrap_or_default();
        let refused = match self.deps.status.allowance(key.namespace()).await {
            Ok((bounds, mut claims)) => {
                // The watch may have brought it before a list shows it.
                if !claims.iter().any(|c| c.uid == uid) {
                    claims.extend(quota::claim_of(vmi, FINALIZER));
                }
                quota::admits(&bounds, &claims, uid)
                    .err()
                    .map(|m| (EventReason::ExceededQuota, m))
            }
            Err(e) => Some((EventReason::QuotaUnknown, e.to_string())),
        };
        let Some((reason, message)) = refused else {
            return Ok(());
        };
        self.wait_for(vmi, key, reason, &message).await;
        Err(ControllerError::Quota {
            id: key.id(),
            message,
        })
    }

    /// A start that cannot go on yet: a warning Event, and the same reason
    /// in the Ready condition while the VMI waits (the loop retries).
    pub(super) async fn wait_for(
        &self,
        vmi: &VirtualMachineInstance,
        key: &VmKey,
        reason: EventReason,
        message: &str,
    ) {
        self.deps.recorder.record(vmi, reason, message, true);
        // Only an administrator can fix this one: not a passing wait.
        let unsynchronized = reason == EventReason::NamespaceNotOptedIn;
        self.set_waiting_as(vmi, key, &format!("{reason:?}"), message, unsynchronized)
            .await;
    }

    /// containerDisks (and kernelBoot images) are pulled before anything is
    /// made on the host, so a registry outage leaves nothing behind: the
    /// error goes to the loop's backoff and the VMI waits in Scheduled, as a
    /// pod waits in ImagePullBackOff. Progress shows in the Ready condition
    /// and the log.
    pub(super) async fn pull_images(
        &self,
        vmi: &VirtualMachineInstance,
        key: &VmKey,
        conv: &Converted,
    ) -> Result<BTreeMap<String, ImageDisk>, ControllerError> {
        let mut disks = BTreeMap::new();
        for need in conv.disks.iter().flat_map(DiskPrep::image_needs) {
            let (volume, image) = (need.key, need.image);
            let failed = |e: ImageError| async move {
                let msg = format!("volume {volume}: {e}");
                self.wait_for(vmi, key, EventReason::ErrImagePull, &msg)
                    .await;
                ControllerError::Image {
                    id: key.id(),
                    source: e,
                }
            };
            let auth = match need.pull_secret {
                None => None,
                Some(secret) => match self.credentials(key, image, secret).await {
                    Ok(c) => c,
                    Err(e) => return Err(failed(e).await),
                },
            };
            let started = tokio::time::Instant::now();
            let latest = Mutex::new(None::<Progress>);
            let downloaded = std::sync::atomic::AtomicBool::new(false);
            let report = |p: Progress| {
                downloaded.store(true, Ordering::Relaxed);
                *latest.lock().unwrap_or_else(|e| e.into_inner()) = Some(p);
            };
            let pull =
                self.deps
                    .images
                    .disk(image, need.pull_policy, need.path, auth.as_ref(), &report);
            tokio::pin!(pull);
            let mut tick = tokio::time::interval(Duration::from_secs(2));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            let result = loop {
                tokio::select! {
                    r = &mut pull => break r,
                    _ = tick.tick() => {
                        let p = latest.lock().unwrap_or_else(|e| e.into_inner()).take();
                        if let Some(p) = p {
                            let msg = format!("pulling {image}: {}", mib_of(p));
                            info!(volume = %volume, "{msg}");
                            self.set_waiting(vmi, key, "PullingContainerDisk", &msg).await;
                        }
                    }
                }
            };
            match result {
                Ok(d) => {
                    let msg = if downloaded.load(Ordering::Relaxed) {
                        format!(
                            "pulled {image} ({}) in {:.1} s",
                            d.digest,
                            started.elapsed().as_secs_f64()
                        )
                    } else {
                        format!("{image} ({}) is already on the host", d.digest)
                    };
                    info!(volume = %volume, "{msg}");
                    self.deps
                        .recorder
                        .record(vmi, EventReason::Pulled, &msg, false);
                    disks.insert(volume.to_owned(), d);
                }
                Err(e) => return Err(failed(e).await),
            }
        }
        Ok(disks)
    }

    /// The registry credentials for `image` in its pull secret; `None`
    /// when the secret has none for that registry (then the pull is
    /// anonymous, as kubelet's).
    async fn credentials(
        &self,
        key: &VmKey,
        image: &str,
        secret: &str,
    ) -> Result<Option<Credentials>, ImageError> {
        let err = |message: String| ImageError::PullSecret {
            image: image.to_owned(),
            secret: secret.to_owned(),
            message,
        };
        let r = crate::core::image::parse_reference(image).map_err(err)?;
        let data = self
            .deps
            .status
            .object(key.namespace(), &ObjectRef::Secret(secret.to_owned()))
            .await
            .map_err(|e| err(e.to_string()))?
            .ok_or_else(|| err("not found".into()))?;
        pullsecret::credentials(&data, r.resolve_registry(), r.repository()).map_err(err)
    }

    /// Why a VM that is not running yet is waiting (the Ready condition),
    /// saved at once; a failed save is retried by the next report. Only
    /// while `vmi` is the instance known by its name (see `report`).
    pub(super) async fn set_waiting(
        &self,
        vmi: &VirtualMachineInstance,
        key: &VmKey,
        reason: &str,
        message: &str,
    ) {
        self.set_waiting_as(vmi, key, reason, message, false).await
    }

    async fn set_waiting_as(
        &self,
        of: &VirtualMachineInstance,
        key: &VmKey,
        reason: &str,
        message: &str,
        unsynchronized: bool,
    ) {
        let id = key.id();
        let vmi = {
            let mut vmis = self.vmis();
            let Some(vmi) = vmis.get_mut(&id).filter(|v| v.uid() == of.uid()) else {
                return;
            };
            let now = now_rfc3339();
            let Some(next) = status::waiting_as(&vmi.status, reason, message, unsynchronized, &now)
            else {
                return;
            };
            vmi.status = next;
            vmi.clone()
        };
        self.unsaved().insert(id.clone());
        match self.deps.status.save(&vmi).await {
            Ok(()) => {
                self.unsaved().remove(&id);
            }
            Err(e) => warn!("status: {e}"),
        }
    }
}

fn mib_of(p: Progress) -> String {
    const MIB: f64 = 1024.0 * 1024.0;
    format!(
        "{:.1} of {:.1} MiB",
        p.done as f64 / MIB,
        p.total as f64 / MIB
    )
}
