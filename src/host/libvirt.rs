//! libvirt: each VM's own session daemon, reached over its socket.
//!
//! Every libvirt call is a blocking RPC, so the adapter runs them on
//! tokio's blocking pool; domain events arrive on libvirt's own event-loop
//! thread and are forwarded as VM ids to the controller's queue.

use crate::core::guestinfo::{GuestDetails, Param};
use crate::core::plan::{DomainObs, DomainState, GuestAgent};
use crate::host::beneath::Beneath;
use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, Once};
use std::time::Duration;
use tokio::sync::mpsc::UnboundedSender;
use virt::connect::Connect;
use virt::domain::Domain;
use virt::sys;

mod migrate;

#[derive(Debug, thiserror::Error)]
pub enum LibvirtError {
    #[error("VM {id}: {op}: {message}")]
    Call {
        id: String,
        op: &'static str,
        message: String,
    },
    #[error("VM {id}: worker thread died")]
    Thread { id: String },
    /// The daemon did not answer in time (stopped, hung, overloaded); the
    /// call may still complete or fail later, on its own thread.
    #[error("VM {id}: its libvirt daemon did not answer {op} within {timeout:?}")]
    Unresponsive {
        id: String,
        op: &'static str,
        timeout: std::time::Duration,
    },
    /// A migration ran past its time (`migration.timeout_seconds`) and was
    /// aborted: the daemon answers, the guest did not move in time.
    #[error(
        "VM {id}: the migration did not end within {} s (migration.timeout_seconds): \
         aborted, the guest runs on here",
        timeout.as_secs()
    )]
    MigrationTimedOut {
        id: String,
        timeout: std::time::Duration,
    },
}

impl LibvirtError {
    /// The daemon did not answer, or could not be reached at all (its
    /// socket gone while its unit runs): either way nothing can be asked
    /// of it, and a VM being removed must still be stopped.
    pub fn is_unresponsive(&self) -> bool {
        matches!(
            self,
            LibvirtError::Unresponsive { .. } | LibvirtError::Call { op: "connect", .. }
        )
    }
}

/// Which VM's daemon, and which domain in it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DomainRef {
    pub id: String,
    pub uri: String,
    pub name: String,
    /// The daemon's socket, below the VM's runtime directory (which the
    /// VM's user can write): connected to beneath that directory, never
    /// through a link planted there.
    pub socket: Option<VmSocket>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VmSocket {
    pub dir: std::path::PathBuf,
    pub rel: std::path::PathBuf,
    /// The unit's main process as systemd says (its libvirt daemon), where
    /// known: only it may listen on the socket.
    pub daemon_pid: Option<u32>,
}

pub trait Hypervisor: Send + Sync + 'static {
    /// The domain's state, or `None` when the daemon has no such domain.
    fn observe(
        &self,
        d: &DomainRef,
    ) -> impl Future<Output = Result<Option<DomainObs>, LibvirtError>> + Send;
    fn define(
        &self,
        d: &DomainRef,
        xml: &str,
    ) -> impl Future<Output = Result<(), LibvirtError>> + Send;
    /// Starts the defined domain; `paused`: with its vCPUs stopped
    /// (`startStrategy: Paused`).
    fn start(
        &self,
        d: &DomainRef,
        paused: bool,
    ) -> impl Future<Output = Result<(), LibvirtError>> + Send;
    /// Pauses (suspends) or resumes the running domain's vCPUs.
    fn set_paused(
        &self,
        d: &DomainRef,
        paused: bool,
    ) -> impl Future<Output = Result<(), LibvirtError>> + Send;
    /// Reboots the guest without a new QEMU: through the guest agent when
    /// one answers, else the ACPI power button (as KubeVirt's soft reboot).
    fn soft_reboot(&self, d: &DomainRef) -> impl Future<Output = Result<(), LibvirtError>> + Send;
    /// Asks the guest to power off (ACPI power button).
    fn shutdown(&self, d: &DomainRef) -> impl Future<Output = Result<(), LibvirtError>> + Send;
    /// Drops any connection to this VM's daemon (it is going away).
    fn forget(&self, id: &str) -> impl Future<Output = ()> + Send;
    /// Changes whenever the VM's domain sends an event: a waiter that
    /// subscribed before looking at the domain wakes on the next change
    /// without asking the daemon over and over. A closed channel means
    /// no events: the waiter polls.
    fn changes(&self, id: &str) -> tokio::sync::watch::Receiver<u64>;
    /// What the QEMU guest agent says, or `None` while no agent is
    /// connected (or the domain does not run).
    fn guest_agent(
        &self,
        d: &DomainRef,
    ) -> impl Future<Output = Result<Option<GuestAgent>, LibvirtError>> + Send;
    /// The agent's logged-in users and filesystems, or `None` while no
    /// agent is connected (or the domain does not run).
    fn guest_details(
        &self,
        d: &DomainRef,
    ) -> impl Future<Output = Result<Option<GuestDetails>, LibvirtError>> + Send;
    /// Asks the daemon at `uri` for the host's capabilities, which makes it
    /// probe QEMU and save its capability cache.
    fn probe(&self, uri: &str) -> impl Future<Output = Result<(), LibvirtError>> + Send;
}

/// The agent's channel is connected: the guest opened its end.
fn agent_connected(live_xml: &str) -> bool {
    live_xml.lines().any(|l| {
        l.contains("org.qemu.guest_agent.0")
            && (l.contains("state='connected'") || l.contains("state=\"connected\""))
    })
}

/// Whether process `pid` runs in the systemd unit `unit` (its cgroup, in
/// the unified hierarchy or a legacy one, ends with the unit's name).
fn in_unit(pid: i32, unit: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .is_ok_and(|text| cgroups_in_unit(&text, unit))
}

fn cgroups_in_unit(proc_cgroup: &str, unit: &str) -> bool {
    let suffix = format!("/{unit}");
    proc_cgroup
        .lines()
        .filter_map(|l| l.splitn(3, ':').nth(2))
        .any(|path| path.ends_with(&suffix))
}

/// libvirt's `os.*` guest info key → KubeVirt's `guestOSInfo` key.
fn guest_os_key(libvirt_key: &str) -> Option<&'static str> {
    Some(match libvirt_key.strip_prefix("os.")? {
        "id" => "id",
        "name" => "name",
        "pretty-name" => "prettyName",
        "version" => "version",
        "version-id" => "versionId",
        "kernel-release" => "kernelRelease",
        "kernel-version" => "kernelVersion",
        "machine" => "machine",
        _ => return None,
    })
}

/// The agent's `guest-get-osinfo` through `virDomainGetGuestInfo` (which,
/// unlike a raw agent command, does not taint the domain).
fn guest_os_info(dom: &Domain) -> Result<std::collections::BTreeMap<String, String>, String> {
    Ok(guest_params(dom, sys::VIR_DOMAIN_GUEST_INFO_OS)?
        .into_iter()
        .filter_map(|(field, value)| match value {
            // The guest wrote it: bounded here, before it is kept anywhere.
            Param::Str(v) => Some((
                guest_os_key(&field)?.to_owned(),
                crate::core::status::guest_text(&v),
            )),
            _ => None,
        })
        .collect())
}

/// `virDomainGetGuestInfo` of `types`: every parameter, by name.
fn guest_params(dom: &Domain, types: u32) -> Result<Vec<(String, Param)>, String> {
    let mut params: sys::virTypedParameterPtr = std::ptr::null_mut();
    let mut n: libc::c_int = 0;
    // SAFETY: dom is a live domain; libvirt allocates params, freed below.
    let r = unsafe { sys::virDomainGetGuestInfo(dom.as_ptr(), types, &mut params, &mut n, 0) };
    if r < 0 {
        return Err(virt::error::Error::last_error().to_string());
    }
    let mut out = Vec::new();
    for i in 0..usize::try_from(n).unwrap_or(0) {
        // SAFETY: libvirt returned n parameters at params.
        let p = unsafe { &*params.add(i) };
        // SAFETY: field is NUL-terminated within its 80 bytes.
        let field = unsafe { std::ffi::CStr::from_ptr(p.field.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: the union member read is the one `type_` names.
        let value = unsafe {
            match p.type_ as u32 {
                sys::VIR_TYPED_PARAM_STRING if !p.value.s.is_null() => Param::Str(
                    std::ffi::CStr::from_ptr(p.value.s)
                        .to_string_lossy()
                        .into_owned(),
                ),
                sys::VIR_TYPED_PARAM_UINT => Param::UInt(p.value.ui.into()),
                sys::VIR_TYPED_PARAM_ULLONG => Param::UInt(p.value.ul),
                sys::VIR_TYPED_PARAM_INT => Param::Int(p.value.i.into()),
                sys::VIR_TYPED_PARAM_LLONG => Param::Int(p.value.l),
                _ => continue,
            }
        };
        out.push((field, value));
    }
    // SAFETY: params and n came from virDomainGetGuestInfo.
    unsafe { sys::virTypedParamsFree(params, n) };
    Ok(out)
}

/// The domain events kvirtd hears: lifecycle changes, and the guest agent
/// (dis)connecting, wake the VM.
const EVENTS: [sys::virDomainEventID; 2] = [
    sys::VIR_DOMAIN_EVENT_ID_LIFECYCLE,
    sys::VIR_DOMAIN_EVENT_ID_AGENT_LIFECYCLE,
];

/// Seconds a guest agent gets to answer before the pass moves on.
const AGENT_TIMEOUT_S: i32 = 2;

struct Conn {
    conn: Connect,
    callback_ids: Vec<i32>,
    /// The domain as last read in full on this connection; see
    /// [`Libvirt::observe_on`].
    known: Option<Known>,
}

/// What a full read of a domain found that only an event can change: its
/// identity, machine type and agent channel. `since` is the VM's event
/// count (`changes`) taken before that read.
struct Known {
    name: String,
    dom: Domain,
    since: u64,
    uid: Option<String>,
    machine: Option<String>,
    agent: bool,
}

impl Known {
    fn obs(&self, state: sys::virDomainState, reason: i32) -> DomainObs {
        DomainObs {
            state: domain_state(state, reason),
            uid: self.uid.clone(),
            paused: (state == sys::VIR_DOMAIN_PAUSED).then(|| pause_reason(reason)),
            machine: self.machine.clone(),
            agent: self.agent,
        }
    }
}

/// One reference to a cached connection; libvirt counts references, so each
/// use closes its own.
struct ConnRef(Connect);

impl Drop for ConnRef {
    fn drop(&mut self) {
        let _ = self.0.close();
    }
}

/// Context handed to libvirt's callbacks; freed by libvirt through `free_ctx`.
struct EventCtx {
    id: String,
    tx: UnboundedSender<String>,
    changes: Arc<tokio::sync::watch::Sender<u64>>,
}

/// One VM's connection. Calls to one daemon take turns; calls to
/// different daemons never wait on each other.
type Slot = Arc<tokio::sync::Mutex<Option<Conn>>>;

/// What kvirtd keeps of one VM's daemon.
#[derive(Clone, Default)]
struct PerVm {
    slot: Slot,
    /// Bumped by each of its domain's events (`changes`).
    changes: Arc<tokio::sync::watch::Sender<u64>>,
}

#[derive(Clone)]
pub struct Libvirt {
    /// Held only to find or add a VM's entry, never across a call.
    vms: Arc<Mutex<HashMap<String, PerVm>>>,
    events: UnboundedSender<String>,
}

/// How long one call (or the wait for the VM's previous call) may take:
/// a daemon that is stopped or hung holds up only its own VM, and only
/// this long.
const CALL_TIMEOUT: Duration = Duration::from_secs(15);
/// Starting a domain probes QEMU when its capability cache is cold.
const START_TIMEOUT: Duration = Duration::from_secs(120);

static EVENT_LOOP: Once = Once::new();

impl Libvirt {
    /// Starts libvirt's event loop thread (once per process); events of
    /// every VM's domain become that VM's id on `events`.
    pub fn new(events: UnboundedSender<String>) -> Self {
        EVENT_LOOP.call_once(|| {
            // Errors come back as values; libvirt's default handler would
            // also print each one to stderr.
            virt::error::clear_error_callback();
            // SAFETY: called once, before any connection is opened.
            unsafe { sys::virEventRegisterDefaultImpl() };
            std::thread::Builder::new()
                .name("libvirt-events".into())
                .spawn(|| loop {
                    // SAFETY: the default impl was registered above.
                    if unsafe { sys::virEventRunDefaultImpl() } < 0 {
                        std::thread::sleep(std::time::Duration::from_millis(100));
                    }
                })
                .expect("spawn libvirt event thread");
        });
        Self {
            vms: Arc::default(),
            events,
        }
    }

    fn err<'a>(
        id: &'a str,
        op: &'static str,
    ) -> impl FnOnce(virt::error::Error) -> LibvirtError + 'a {
        move |e| LibvirtError::Call {
            id: id.into(),
            op,
            message: e.to_string(),
        }
    }

    /// A live connection to the VM's daemon, opened (with event callbacks)
    /// on first use and reopened when the old one died.
    fn connect(&self, slot: &mut Option<Conn>, d: &DomainRef) -> Result<ConnRef, LibvirtError> {
        if let Some(c) = slot.as_ref() {
            if c.conn.is_alive().unwrap_or(false) {
                return Ok(ConnRef(c.conn.clone()));
            }
        }
        if let Some(old) = slot.take() {
            close(old);
        }
        let conn = match &d.socket {
            None => Connect::open(Some(&d.uri)),
            Some(s) => {
                let refuse = |message: String| LibvirtError::Call {
                    id: d.id.clone(),
                    op: "connect",
                    message: format!("{}: {message}", s.dir.join(&s.rel).display()),
                };
                let (sock, owner) = Beneath::open(&s.dir)
                    .and_then(|dir| Ok((dir.socket(&s.rel)?, dir.owner()?)))
                    .map_err(|e| refuse(e.to_string()))?;
                // Root speaks libvirt only to the VM's own daemon: the
                // socket must be listened on by a process of the VM's unit
                // running as the VM (whose directory it is), not by
                // anything else its user bound there.
                let (pid, uid) = sock.listener().map_err(|e| refuse(e.to_string()))?;
                let unit = crate::core::key::unit_name_of(&d.id);
                if uid != owner || !in_unit(pid, &unit) {
                    return Err(refuse(format!(
                        "listened on by pid {pid} (uid {uid}), not the VM's daemon in {unit}"
                    )));
                }
                // ...and by the daemon itself, the unit's main process, not
                // another process of the unit: an escaped QEMU runs there as
                // the VM too. (Unknown only while kvirtd starts a new unit,
                // before any QEMU of it exists.)
                if s.daemon_pid
                    .is_some_and(|main| i64::from(main) != i64::from(pid))
                {
                    return Err(refuse(format!(
                        "listened on by pid {pid}, not the VM's daemon in {unit} (pid {})",
                        s.daemon_pid.unwrap_or_default()
                    )));
                }
                Connect::open(Some(&format!(
                    "qemu:///session?socket={}",
                    sock.path().display()
                )))
            }
        }
        .map_err(Self::err(&d.id, "connect"))?;
        // Notices a daemon that hangs without closing the socket (one that
        // dies closes it) within about as long as the resync, whose calls
        // time out on a hung one too. Every two minutes: at a hundred VMs,
        // pings were most of kvirtd's idle CPU.
        let _ = conn.set_keep_alive(120, 2);
        let callback_ids = EVENTS
            .into_iter()
            .map(|event| self.register(&conn, &d.id, event as i32))
            .filter(|id| *id >= 0)
            .collect();
        let c = ConnRef(conn.clone());
        *slot = Some(Conn {
            conn,
            callback_ids,
            known: None,
        });
        Ok(c)
    }

    /// Registers `on_event` for one event of every domain on `conn`; both
    /// events used pass (state, reason) ints, so one callback serves them.
    fn register(&self, conn: &Connect, id: &str, event: i32) -> i32 {
        let ctx = Box::into_raw(Box::new(EventCtx {
            id: id.to_owned(),
            tx: self.events.clone(),
            changes: self.vm(id).changes,
        }));
        // SAFETY: the callback matches libvirt's signature for these events;
        // ctx is owned by libvirt from here and freed through `free_ctx`.
        let callback_id = unsafe {
            let cb: unsafe extern "C" fn(
                sys::virConnectPtr,
                sys::virDomainPtr,
                i32,
                i32,
                *mut libc::c_void,
            ) -> i32 = on_event;
            sys::virConnectDomainEventRegisterAny(
                conn.as_ptr(),
                std::ptr::null_mut(),
                event,
                Some(std::mem::transmute::<
                    unsafe extern "C" fn(
                        sys::virConnectPtr,
                        sys::virDomainPtr,
                        i32,
                        i32,
                        *mut libc::c_void,
                    ) -> i32,
                    unsafe extern "C" fn(sys::virConnectPtr, sys::virDomainPtr, *mut libc::c_void),
                >(cb)),
                ctx.cast(),
                Some(free_ctx),
            )
        };
        if callback_id < 0 {
            // SAFETY: registration failed, so libvirt did not take ctx.
            drop(unsafe { Box::from_raw(ctx) });
        }
        callback_id
    }

    fn vm(&self, id: &str) -> PerVm {
        let mut vms = self.vms.lock().unwrap_or_else(|p| p.into_inner());
        vms.entry(id.to_owned()).or_default().clone()
    }

    /// Runs `f` on the blocking pool with the VM's connection, bounded by
    /// `timeout` twice: waiting for the VM's previous call, then the call.
    /// A call that times out keeps its thread and the VM's slot until the
    /// daemon answers or its keepalive gives up; later calls for that VM
    /// fail fast meanwhile, and no other VM notices.
    async fn blocking<T: Send + 'static>(
        &self,
        d: &DomainRef,
        op: &'static str,
        timeout: Duration,
        f: impl FnOnce(&Self, &mut Option<Conn>, &DomainRef) -> Result<T, LibvirtError> + Send + 'static,
    ) -> Result<T, LibvirtError> {
        let unresponsive = || LibvirtError::Unresponsive {
            id: d.id.clone(),
            op,
            timeout,
        };
        let mut slot = tokio::time::timeout(timeout, self.vm(&d.id).slot.lock_owned())
            .await
            .map_err(|_| unresponsive())?;
        let this = self.clone();
        let dr = d.clone();
        let call = tokio::task::spawn_blocking(move || f(&this, &mut slot, &dr));
        match tokio::time::timeout(timeout, call).await {
            Err(_) => Err(unresponsive()),
            Ok(Err(_)) => Err(LibvirtError::Thread { id: d.id.clone() }),
            Ok(Ok(r)) => r,
        }
    }

    /// The running domain whose guest agent is connected, with the
    /// agent's answers bounded in time; `None` otherwise.
    fn agent_domain(
        &self,
        slot: &mut Option<Conn>,
        d: &DomainRef,
    ) -> Result<Option<(ConnRef, Domain)>, LibvirtError> {
        let (conn, Some(dom)) = self.lookup(slot, d)? else {
            return Ok(None);
        };
        if !dom.is_active().unwrap_or(false) {
            return Ok(None);
        }
        let xml = dom
            .get_xml_desc(0)
            .map_err(Libvirt::err(&d.id, "domain XML"))?;
        if !agent_connected(&bounded_xml(xml, d)?) {
            return Ok(None);
        }
        // SAFETY: dom is a live domain.
        unsafe { sys::virDomainAgentSetResponseTimeout(dom.as_ptr(), AGENT_TIMEOUT_S, 0) };
        Ok(Some((conn, dom)))
    }

    /// The domain's state: one call while no event of the domain came
    /// since it was last read in full (a lifecycle or agent event is what
    /// changes the rest), else lookup, state and XML. Every VM is looked
    /// at on every resync and each second of its grace period: one call
    /// to its daemon where there were three.
    fn observe_on(
        &self,
        slot: &mut Option<Conn>,
        d: &DomainRef,
    ) -> Result<Option<DomainObs>, LibvirtError> {
        // Taken first: an event during the read makes the next look a full one.
        let seen = *self.vm(&d.id).changes.borrow();
        let conn = self.connect(slot, d)?;
        let cached = slot.as_mut().and_then(|c| c.known.take());
        if let Some(k) = cached.filter(|k| k.since == seen && k.name == d.name) {
            match k.dom.get_state() {
                Ok((state, reason)) => {
                    let obs = k.obs(state, reason);
                    if let Some(c) = slot.as_mut() {
                        c.known = Some(k);
                    }
                    return Ok(Some(obs));
                }
                // Undefined (or replaced) since: looked up afresh.
                Err(e) if e.code() == virt::error::ErrorNumber::NoDomain => {}
                Err(e) => return Err(Self::err(&d.id, "domain state")(e)),
            }
        }
        drop(conn);
        let (_conn, dom) = self.lookup(slot, d)?;
        let Some(dom) = dom else { return Ok(None) };
        let (state, reason) = dom
            .get_state()
            .map_err(Libvirt::err(&d.id, "domain state"))?;
        let xml = dom
            .get_xml_desc(0)
            .map_err(Libvirt::err(&d.id, "domain XML"))?;
        let xml = bounded_xml(xml, d)?;
        let known = Known {
            name: d.name.clone(),
            dom,
            since: seen,
            uid: metadata_uid(&xml),
            machine: machine_type(&xml),
            agent: agent_connected(&xml),
        };
        let obs = known.obs(state, reason);
        // Kept only where both events are heard: without them nothing
        // would say the cache is stale.
        if let Some(c) = slot
            .as_mut()
            .filter(|c| c.callback_ids.len() == EVENTS.len())
        {
            c.known = Some(known);
        }
        Ok(Some(obs))
    }

    fn lookup(
        &self,
        slot: &mut Option<Conn>,
        d: &DomainRef,
    ) -> Result<(ConnRef, Option<Domain>), LibvirtError> {
        let conn = self.connect(slot, d)?;
        match Domain::lookup_by_name(&conn.0, &d.name) {
            Ok(dom) => Ok((conn, Some(dom))),
            Err(e) if e.code() == virt::error::ErrorNumber::NoDomain => Ok((conn, None)),
            Err(e) => Err(Self::err(&d.id, "lookup domain")(e)),
        }
    }
}

fn close(mut c: Conn) {
    for id in c.callback_ids {
        // SAFETY: the id came from this connection's registration.
        unsafe { sys::virConnectDomainEventDeregisterAny(c.conn.as_ptr(), id) };
    }
    let _ = c.conn.close();
}

unsafe extern "C" fn on_event(
    _conn: sys::virConnectPtr,
    _dom: sys::virDomainPtr,
    _event: i32,
    _detail: i32,
    opaque: *mut libc::c_void,
) -> i32 {
    // SAFETY: opaque is the EventCtx registered with this callback.
    let ctx = unsafe { &*(opaque as *const EventCtx) };
    ctx.changes.send_modify(|n| *n = n.wrapping_add(1));
    let _ = ctx.tx.send(ctx.id.clone());
    0
}

unsafe extern "C" fn free_ctx(opaque: *mut libc::c_void) {
    // SAFETY: libvirt frees each registration's ctx exactly once.
    drop(unsafe { Box::from_raw(opaque as *mut EventCtx) });
}

fn domain_state(state: sys::virDomainState, reason: i32) -> DomainState {
    match state {
        sys::VIR_DOMAIN_RUNNING | sys::VIR_DOMAIN_BLOCKED | sys::VIR_DOMAIN_SHUTDOWN => {
            DomainState::Running
        }
        sys::VIR_DOMAIN_PAUSED | sys::VIR_DOMAIN_PMSUSPENDED => DomainState::Paused,
        sys::VIR_DOMAIN_CRASHED => DomainState::Crashed,
        sys::VIR_DOMAIN_SHUTOFF => match reason as u32 {
            sys::VIR_DOMAIN_SHUTOFF_SHUTDOWN => DomainState::Shutdown,
            sys::VIR_DOMAIN_SHUTOFF_CRASHED | sys::VIR_DOMAIN_SHUTOFF_FAILED => {
                DomainState::Crashed
            }
            _ => DomainState::Shutoff,
        },
        _ => DomainState::Other,
    }
}

/// The domain, or the error of an operation on a domain that is not there.
fn defined(dom: Option<Domain>, d: &DomainRef, op: &'static str) -> Result<Domain, LibvirtError> {
    dom.ok_or_else(|| LibvirtError::Call {
        id: d.id.clone(),
        op,
        message: "domain is not defined".into(),
    })
}

/// KubeVirt's `Paused` condition reason for libvirt's pause reason.
fn pause_reason(reason: i32) -> String {
    match reason as u32 {
        sys::VIR_DOMAIN_PAUSED_USER => "PausedByUser".into(),
        sys::VIR_DOMAIN_PAUSED_IOERROR => "PausedIOError".into(),
        sys::VIR_DOMAIN_PAUSED_STARTING_UP => "PausedStartStrategy".into(),
        sys::VIR_DOMAIN_PAUSED_WATCHDOG => "PausedWatchdog".into(),
        sys::VIR_DOMAIN_PAUSED_SHUTTING_DOWN => "PausedShuttingDown".into(),
        other => format!("Paused (libvirt reason {other})"),
    }
}

/// The machine type of the live domain XML (libvirt expands an alias such
/// as `q35` to the versioned type QEMU runs).
fn machine_type(xml: &str) -> Option<String> {
    let os = &xml[xml.find("<os")?..];
    let ty = &os[os.find("<type")?..];
    let attr = &ty[ty
        .find("machine='")
        .map(|i| i + 9)
        .or_else(|| ty.find("machine=\"").map(|i| i + 9))?..];
    let end = attr.find(['\'', '"'])?;
    Some(attr[..end].to_owned()).filter(|m| !m.is_empty() && m.len() <= FIELD_MAX)
}

/// The VM's daemon is the VM's (its user may have replaced it): what it
/// answers is bounded before kvirtd keeps any of it.
const XML_MAX: usize = 4 << 20;
const FIELD_MAX: usize = 128;

fn bounded_xml(xml: String, d: &DomainRef) -> Result<String, LibvirtError> {
    if xml.len() > XML_MAX {
        return Err(LibvirtError::Call {
            id: d.id.clone(),
            op: "domain XML",
            message: format!("{} bytes, more than a domain has ({XML_MAX})", xml.len()),
        });
    }
    Ok(xml)
}

/// The VMI UID from the domain's kvirt metadata element.
fn metadata_uid(xml: &str) -> Option<String> {
    let start = xml.find(":uid>").map(|i| i + 5).or_else(|| {
        let i = xml.find("<uid>")?;
        Some(i + 5)
    })?;
    let rest = &xml[start..];
    Some(rest[..rest.find('<')?].trim().to_owned())
        .filter(|s| !s.is_empty() && s.len() <= FIELD_MAX)
}

impl Hypervisor for Libvirt {
    async fn observe(&self, d: &DomainRef) -> Result<Option<DomainObs>, LibvirtError> {
        self.blocking(d, "observe", CALL_TIMEOUT, |this, slot, d| {
            this.observe_on(slot, d)
        })
        .await
    }

    async fn define(&self, d: &DomainRef, xml: &str) -> Result<(), LibvirtError> {
        let xml = xml.to_owned();
        self.blocking(d, "define", START_TIMEOUT, move |this, slot, d| {
            let conn = this.connect(slot, d)?;
            Domain::define_xml(&conn.0, &xml).map_err(Libvirt::err(&d.id, "define"))?;
            Ok(())
        })
        .await
    }

    async fn start(&self, d: &DomainRef, paused: bool) -> Result<(), LibvirtError> {
        self.blocking(d, "start", START_TIMEOUT, move |this, slot, d| {
            let dom = defined(this.lookup(slot, d)?.1, d, "start")?;
            let flags = if paused {
                sys::VIR_DOMAIN_START_PAUSED
            } else {
                0
            };
            dom.create_with_flags(flags)
                .map_err(Libvirt::err(&d.id, "start"))?;
            Ok(())
        })
        .await
    }

    async fn set_paused(&self, d: &DomainRef, paused: bool) -> Result<(), LibvirtError> {
        let op = if paused { "pause" } else { "unpause" };
        self.blocking(d, op, CALL_TIMEOUT, move |this, slot, d| {
            let dom = defined(this.lookup(slot, d)?.1, d, op)?;
            if paused { dom.suspend() } else { dom.resume() }.map_err(Libvirt::err(&d.id, op))?;
            Ok(())
        })
        .await
    }

    async fn soft_reboot(&self, d: &DomainRef) -> Result<(), LibvirtError> {
        self.blocking(d, "soft-reboot", CALL_TIMEOUT, |this, slot, d| {
            let dom = defined(this.lookup(slot, d)?.1, d, "soft-reboot")?;
            dom.reboot(sys::VIR_DOMAIN_REBOOT_GUEST_AGENT)
                .or_else(|_| dom.reboot(sys::VIR_DOMAIN_REBOOT_ACPI_POWER_BTN))
                .map_err(Libvirt::err(&d.id, "soft-reboot"))?;
            Ok(())
        })
        .await
    }

    async fn shutdown(&self, d: &DomainRef) -> Result<(), LibvirtError> {
        self.blocking(d, "shutdown", CALL_TIMEOUT, |this, slot, d| {
            if let (_c, Some(dom)) = this.lookup(slot, d)? {
                dom.shutdown_flags(sys::VIR_DOMAIN_SHUTDOWN_ACPI_POWER_BTN)
                    .map_err(Libvirt::err(&d.id, "shutdown"))?;
            }
            Ok(())
        })
        .await
    }

    async fn guest_agent(&self, d: &DomainRef) -> Result<Option<GuestAgent>, LibvirtError> {
        self.blocking(d, "ask the guest agent", CALL_TIMEOUT, |this, slot, d| {
            let Some((_conn, dom)) = this.agent_domain(slot, d)? else {
                return Ok(None);
            };
            // A slow agent is asked again at the next pass, and one
            // without guest-get-osinfo is still an agent.
            let os_info = guest_os_info(&dom).unwrap_or_else(|e| {
                tracing::debug!("guest OS info: {e}");
                Default::default()
            });
            Ok(Some(GuestAgent { os_info }))
        })
        .await
    }

    async fn guest_details(&self, d: &DomainRef) -> Result<Option<GuestDetails>, LibvirtError> {
        self.blocking(d, "ask the guest agent", CALL_TIMEOUT, |this, slot, d| {
            let Some((_conn, dom)) = this.agent_domain(slot, d)? else {
                return Ok(None);
            };
            let types = sys::VIR_DOMAIN_GUEST_INFO_USERS | sys::VIR_DOMAIN_GUEST_INFO_FILESYSTEM;
            let params = guest_params(&dom, types).map_err(|message| LibvirtError::Call {
                id: d.id.clone(),
                op: "ask the guest agent",
                message,
            })?;
            Ok(Some(crate::core::guestinfo::parse(&params)))
        })
        .await
    }

    async fn probe(&self, uri: &str) -> Result<(), LibvirtError> {
        let uri = uri.to_owned();
        tokio::task::spawn_blocking(move || {
            let err = |op| Libvirt::err("probe", op);
            let mut conn = Connect::open(Some(&uri)).map_err(err("connect"))?;
            let caps = conn.get_capabilities().map_err(err("capabilities"));
            let _ = conn.close();
            caps.map(drop)
        })
        .await
        .map_err(|_| LibvirtError::Thread { id: "probe".into() })?
    }

    fn changes(&self, id: &str) -> tokio::sync::watch::Receiver<u64> {
        self.vm(id).changes.subscribe()
    }

    async fn forget(&self, id: &str) {
        let vm = self
            .vms
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        // A slot still held by a stuck call is left to it: the daemon is
        // being stopped, which ends the call.
        let Some(mut conn) = vm.and_then(|v| v.slot.try_lock_owned().ok()) else {
            return;
        };
        let _ = tokio::task::spawn_blocking(move || {
            if let Some(c) = conn.take() {
                close(c);
            }
        })
        .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shutoff_reasons_map_to_outcomes() {
        assert_eq!(
            domain_state(
                sys::VIR_DOMAIN_SHUTOFF,
                sys::VIR_DOMAIN_SHUTOFF_SHUTDOWN as i32
            ),
            DomainState::Shutdown
        );
        assert_eq!(
            domain_state(
                sys::VIR_DOMAIN_SHUTOFF,
                sys::VIR_DOMAIN_SHUTOFF_CRASHED as i32
            ),
            DomainState::Crashed
        );
        assert_eq!(
            domain_state(
                sys::VIR_DOMAIN_SHUTOFF,
                sys::VIR_DOMAIN_SHUTOFF_UNKNOWN as i32
            ),
            DomainState::Shutoff
        );
        assert_eq!(
            domain_state(sys::VIR_DOMAIN_RUNNING, 1),
            DomainState::Running
        );
    }

    #[test]
    fn only_a_process_of_the_vms_unit_is_its_daemon() {
        let unit = "kvirt-vm@default_a.service";
        let hybrid = "1:name=systemd:/machine-kvirt.slice/kvirt-vm@default_a.service\n0::/machine-kvirt.slice/kvirt-vm@default_a.service\n";
        assert!(cgroups_in_unit(hybrid, unit));
        assert!(cgroups_in_unit(
            "0::/machine.slice/kvirt-vm@default_a.service\n",
            unit
        ));
        for other in [
            "0::/machine-kvirt.slice/kvirt-vm@default_ab.service\n",
            "0::/machine-kvirt.slice/kvirt-vm@default_a.service/sub\n",
            "0::/user.slice/user-1000.slice/session-1.scope\n",
            "",
        ] {
            assert!(!cgroups_in_unit(other, unit), "{other}");
        }
        let long = format!("<kvirt:uid>{}</kvirt:uid>", "u".repeat(1000));
        assert_eq!(metadata_uid(&long), None, "a UID is short");
    }

    #[test]
    fn the_agent_is_connected_when_its_channel_says_so() {
        let live = "<channel type='unix'>\n  <target type='virtio' name='org.qemu.guest_agent.0' state='connected'/>\n</channel>";
        assert!(agent_connected(live));
        assert!(!agent_connected(
            &live.replace("'connected'", "'disconnected'")
        ));
        assert!(!agent_connected("<domain/>"));
    }

    #[test]
    fn guest_os_info_has_kubevirts_keys() {
        assert_eq!(guest_os_key("os.pretty-name"), Some("prettyName"));
        assert_eq!(guest_os_key("os.version-id"), Some("versionId"));
        assert_eq!(guest_os_key("os.kernel-release"), Some("kernelRelease"));
        assert_eq!(guest_os_key("os.variant"), None);
        assert_eq!(guest_os_key("timezone.name"), None);
    }

    #[test]
    fn uid_comes_from_metadata() {
        let xml = r#"<domain><metadata><kvirt:vm xmlns:kvirt="x"><kvirt:uid>abc-1</kvirt:uid></kvirt:vm></metadata></domain>"#;
        assert_eq!(metadata_uid(xml).as_deref(), Some("abc-1"));
        assert_eq!(metadata_uid("<domain/>"), None);
    }

    #[test]
    fn machine_type_and_pause_reason_as_kubevirt_shows_them() {
        let xml =
            "<domain><os>\n<type arch='x86_64' machine='pc-q35-10.0'>hvm</type></os></domain>";
        assert_eq!(machine_type(xml).as_deref(), Some("pc-q35-10.0"));
        assert_eq!(machine_type("<domain><os/></domain>"), None);
        assert_eq!(
            pause_reason(sys::VIR_DOMAIN_PAUSED_USER as i32),
            "PausedByUser"
        );
        assert_eq!(
            pause_reason(sys::VIR_DOMAIN_PAUSED_IOERROR as i32),
            "PausedIOError"
        );
    }

    /// libvirt's own test driver: a real libvirt connection with no daemon.
    #[tokio::test]
    async fn observes_domains_through_real_libvirt() {
        let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
        let lv = Libvirt::new(tx);
        let d = DomainRef {
            id: "test".into(),
            uri: "test:///default".into(),
            name: "test".into(),
            socket: None,
        };
        let obs = lv.observe(&d).await.unwrap().unwrap();
        assert_eq!(obs.state, DomainState::Running);
        let missing = DomainRef {
            name: "nope".into(),
            ..d.clone()
        };
        assert_eq!(lv.observe(&missing).await.unwrap(), None);
        lv.forget("test").await;
    }
}
