//! Events on VMIs, with KubeVirt's reasons.

use crate::core::vmi::VirtualMachineInstance;
use crate::sources::{EventReason, Recorder};
use kube::runtime::events::{Event, EventType, Recorder as KubeRecorder, Reporter};
use kube::Resource;
use tracing::warn;

pub struct KubeEvents {
    recorder: KubeRecorder,
}

impl KubeEvents {
    pub fn new(client: kube::Client, node: &str) -> Self {
        let reporter = Reporter {
            controller: "kvirtd".into(),
            instance: Some(node.into()),
        };
        Self {
            recorder: KubeRecorder::new(client, reporter),
        }
    }
}

impl Recorder for KubeEvents {
    fn record(
        &self,
        vmi: &VirtualMachineInstance,
        reason: EventReason,
        message: &str,
        warning: bool,
    ) {
        let event = Event {
            type_: if warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: format!("{reason:?}"),
            note: Some(message.chars().take(1024).collect()),
            action: "Reconcile".into(),
            secondary: None,
        };
        let reference = vmi.object_ref(&());
        let recorder = self.recorder.clone();
        // Events are best effort and must never hold up the VM's loop.
        tokio::spawn(async move {
            if let Err(e) = recorder.publish(&event, &reference).await {
                warn!(
                    vmi = reference.name.as_deref().unwrap_or("?"),
                    "recording event {}: {e}", event.reason
                );
            }
        });
    }
}
