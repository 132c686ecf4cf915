//! The subresources of a VMI this host runs: pause, unpause and soft
//! reboot through the controller (as `kvirtctl` does them), the guest
//! agent's answers, and the console and VNC sockets of its QEMU.

use super::{error, json, stream, Api, Body};
use crate::core::guestinfo;
use crate::core::key::VmKey;
use crate::core::layout::HostLayout;
use crate::core::subresource::admit::admit;
use crate::core::subresource::{ApiError, VmiAction};
use crate::core::vmi::VirtualMachineInstance;
use crate::daemon::controller::{self, VmiView};
use crate::host::beneath::Beneath;
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

pub struct Local {
    pub view: Arc<dyn VmiView>,
    pub layout: HostLayout,
}

impl Local {
    /// The VMI as this host runs it, if the action can be served now.
    fn admitted(&self, key: &VmKey, action: VmiAction) -> Result<VirtualMachineInstance, ApiError> {
        let (vmi, _) = self.view.view(&key.id());
        admit(action, key.name(), vmi.as_ref())?;
        vmi.ok_or_else(|| ApiError::internal("admitted without a VMI"))
    }

    /// A connection to the VM's console or VNC socket, found beneath its
    /// runtime directory (the VM's user writes there: a link planted in
    /// the socket's place is never followed).
    pub async fn connect(
        &self,
        key: &VmKey,
        action: VmiAction,
    ) -> Result<tokio::net::UnixStream, ApiError> {
        let paths = self.layout.vm(key);
        let path = match action {
            VmiAction::Vnc => paths.vnc_socket(),
            _ => paths.serial_socket(),
        };
        let rel = path
            .strip_prefix(&paths.runtime_dir)
            .map_err(|_| ApiError::internal("socket outside the VM's runtime directory"))?
            .to_owned();
        let socket = Beneath::open(&paths.runtime_dir)
            .and_then(|d| d.socket(&rel))
            .map_err(|e| {
                ApiError::bad_request(format!("VMI {} has no {}: {e}", key.name(), action.name()))
            })?;
        let connect = tokio::net::UnixStream::connect(socket.path());
        match tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
            Ok(Ok(s)) => Ok(s),
            Ok(Err(e)) => Err(ApiError::bad_request(format!(
                "VMI {}: connecting to its {}: {e}",
                key.name(),
                action.name()
            ))),
            Err(_) => Err(ApiError::conflict(format!(
                "VMI {}: its {} does not answer",
                key.name(),
                action.name()
            ))),
        }
    }

    async fn act(
        &self,
        key: &VmKey,
        action: VmiAction,
        act: controller::VmiAction,
    ) -> Result<(), ApiError> {
        self.admitted(key, action)?;
        self.view
            .act(&key.id(), act)
            .await
            .map(drop)
            .map_err(|e| ApiError::conflict_on("virtualmachineinstance", key.name(), &e))
    }

    /// What the guest agent last told of the guest: KubeVirt's
    /// VirtualMachineInstanceGuestAgentInfo, from what kvirt reports.
    fn guest_os_info(&self, key: &VmKey) -> Result<serde_json::Value, ApiError> {
        let vmi = self.admitted(key, VmiAction::GuestOsInfo)?;
        let os = vmi
            .status
            .extra
            .get("guestOSInfo")
            .cloned()
            .unwrap_or(json!({}));
        Ok(json!({"os": os}))
    }
}

impl Local {
    /// `userlist` or `filesystemlist`, asked of the guest agent now.
    async fn guest_list(
        &self,
        key: &VmKey,
        action: VmiAction,
    ) -> Result<serde_json::Value, ApiError> {
        self.admitted(key, action)?;
        let details = self
            .view
            .guest_details(&key.id())
            .await
            .map_err(ApiError::internal)?
            .ok_or_else(|| {
                ApiError::conflict_on(
                    "virtualmachineinstance",
                    key.name(),
                    "VMI does not have guest agent connected",
                )
            })?;
        Ok(match action {
            VmiAction::UserList => guestinfo::user_list(&details),
            _ => guestinfo::filesystem_list(&details),
        })
    }
}

impl Api {
    pub(super) async fn local_vmi(
        self: &Arc<Self>,
        key: &VmKey,
        action: VmiAction,
        req: Request<Incoming>,
    ) -> Response<Body> {
        let done = |r: Result<(), ApiError>| match r {
            Ok(()) => super::respond(StatusCode::OK, vec![]),
            Err(e) => error(&e),
        };
        match action {
            VmiAction::Pause => done(
                self.local
                    .act(key, action, controller::VmiAction::Pause)
                    .await,
            ),
            VmiAction::Unpause => done(
                self.local
                    .act(key, action, controller::VmiAction::Unpause)
                    .await,
            ),
            VmiAction::SoftReboot => done(
                self.local
                    .act(key, action, controller::VmiAction::SoftReboot)
                    .await,
            ),
            VmiAction::GuestOsInfo => match self.local.guest_os_info(key) {
                Ok(v) => json(StatusCode::OK, &v),
                Err(e) => error(&e),
            },
            VmiAction::UserList | VmiAction::FilesystemList => {
                match self.local.guest_list(key, action).await {
                    Ok(v) => json(StatusCode::OK, &v),
                    Err(e) => error(&e),
                }
            }
            VmiAction::Console | VmiAction::Vnc => {
                if let Err(e) = self.local.admitted(key, action) {
                    return error(&e);
                }
                stream::open(self.clone(), key, action, req).await
            }
        }
    }
}
