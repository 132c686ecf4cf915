//! The pod-like network of each VM, without a pod or CNI: a veth from the
//! host bridge `kvirt0` into the VM's namespace (`eth0`), and inside it
//! KubeVirt's masquerade layout — bridge `k6t-eth0`, `tap0` for QEMU, the
//! guest at 10.0.2.2.
//!
//! Netlink sockets belong to the namespace they are opened in, so all work
//! inside a VM's namespace happens on a short-lived thread that entered it;
//! never on an async worker.

use crate::core::convert::network::{NetSpec, Secondary, TAP};
use crate::core::nft::{self as rules, VmSource};
use crate::host::bridging::{Attached, LeaseDefaults, SecondaryNets, VmMeta};
use crate::host::nft;
use nix::sched::{setns, CloneFlags};
use sha2::{Digest, Sha256};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};

pub const HOST_BRIDGE: &str = "kvirt0";
pub const POD_IFACE: &str = "eth0";
pub const VM_BRIDGE: &str = "k6t-eth0";
/// KubeVirt's masquerade defaults.
pub const VM_BRIDGE_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0];
pub const VM_GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 1);
pub const VM_PREFIX: u8 = 24;
/// KubeVirt's IPv6 masquerade: `k6t-eth0` is the guest's router.
pub const VM_GATEWAY6: Ipv6Addr = crate::core::dhcp6::GATEWAY;

#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    #[error("VM {id}: {message}")]
    Vm { id: String, message: String },
    #[error("{what}: {message}")]
    Netlink { what: String, message: String },
    #[error("{what}: {source}")]
    Sys {
        what: String,
        source: std::io::Error,
    },
    #[error("network worker thread died")]
    Thread,
}

/// Everything that makes one VM's network, decided before any of it is made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VmNetwork {
    pub netns_path: PathBuf,
    /// Host end of the veth (≤ 15 bytes, derived from the VM id).
    pub host_veth: String,
    pub pod_ip: Ipv4Addr,
    pub pod_prefix: u8,
    pub pod_gateway: Ipv4Addr,
    /// Dual stack: `eth0`'s IPv6 address, its prefix and the host's
    /// gateway; `k6t-eth0` then gets [`VM_GATEWAY6`] as well.
    pub pod_v6: Option<PodV6>,
    pub mtu: u32,
    /// `k6t-eth0`'s address: the guest's router (KubeVirt: 10.0.2.1/24).
    pub vm_gateway: Ipv4Addr,
    pub vm_prefix: u8,
    /// Owner of `tap0`: the VM's unprivileged user.
    pub tap_uid: u32,
    pub tap_gid: u32,
}

/// A VM's IPv6 side of the pod network.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PodV6 {
    pub ip: Ipv6Addr,
    pub prefix: u8,
    pub gateway: Ipv6Addr,
}

/// Interface names are limited to 15 bytes: a hash of the id keeps them
/// unique and deterministic.
pub fn host_veth_name(id: &str) -> String {
    let h = Sha256::digest(id.as_bytes());
    let hex: String = h.iter().take(6).map(|b| format!("{b:02x}")).collect();
    format!("kv{hex}")
}

/// Whether a host link's name is of [`host_veth_name`]'s form.
pub fn is_host_veth_name(name: &str) -> bool {
    name.len() == 14
        && name.starts_with("kv")
        && name[2..]
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

pub(crate) fn nl(what: impl Into<String>) -> impl FnOnce(rtnetlink::Error) -> NetworkError {
    let what = what.into();
    move |e| NetworkError::Netlink {
        what,
        message: e.to_string(),
    }
}

/// Runs `f` with a netlink handle on a fresh thread, inside `netns` when
/// given, and waits for it.
pub(crate) fn in_netns<T: Send + 'static>(
    netns: Option<PathBuf>,
    f: impl FnOnce(
            rtnetlink::Handle,
        )
            -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<T, NetworkError>>>>
        + Send
        + 'static,
) -> Result<T, NetworkError> {
    std::thread::spawn(move || {
        if let Some(path) = netns {
            let file = std::fs::File::open(&path).map_err(|source| NetworkError::Sys {
                what: format!("open {}", path.display()),
                source,
            })?;
            setns(file.as_fd(), CloneFlags::CLONE_NEWNET).map_err(|e| NetworkError::Sys {
                what: format!("setns {}", path.display()),
                source: e.into(),
            })?;
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|source| NetworkError::Sys {
                what: "runtime".into(),
                source,
            })?;
        rt.block_on(async move {
            let (conn, handle, _) =
                rtnetlink::new_connection().map_err(|source| NetworkError::Sys {
                    what: "netlink socket".into(),
                    source,
                })?;
            tokio::spawn(conn);
            f(handle).await
        })
    })
    .join()
    .map_err(|_| NetworkError::Thread)?
}

pub(crate) async fn index_of(
    h: &rtnetlink::Handle,
    name: &str,
) -> Result<Option<u32>, NetworkError> {
    use futures::TryStreamExt;
    let mut links = h.link().get().match_name(name.to_owned()).execute();
    match links.try_next().await {
        Ok(Some(l)) => Ok(Some(l.header.index)),
        Ok(None) => Ok(None),
        Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::ENODEV => Ok(None),
        Err(e) => Err(nl(format!("find {name}"))(e)),
    }
}

async fn add_addr(
    h: &rtnetlink::Handle,
    index: u32,
    ip: IpAddr,
    prefix: u8,
    what: &str,
) -> Result<(), NetworkError> {
    use rtnetlink::packet_route::address::{AddressAttribute, AddressFlags};
    let mut req = h.address().add(index, ip, prefix);
    if ip.is_ipv6() {
        // Unique by construction (paired with a unique IPv4 lease, or the
        // namespace's private router address): duplicate detection would
        // only keep it tentative, unusable, for a second or more.
        req.message_mut()
            .attributes
            .push(AddressAttribute::Flags(AddressFlags::Nodad));
    }
    match req.execute().await {
        Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::EEXIST => Ok(()),
        r => r.map_err(nl(format!("address {ip}/{prefix} on {what}"))),
    }
}

pub(crate) async fn ensure_bridge(
    h: &rtnetlink::Handle,
    name: &str,
    mac: Option<[u8; 6]>,
    mtu: Option<u32>,
) -> Result<u32, NetworkError> {
    if let Some(i) = index_of(h, name).await? {
        return Ok(i);
    }
    let mut b = rtnetlink::LinkBridge::new(name);
    if let Some(m) = mac {
        b = b.address(m.to_vec());
    }
    if let Some(m) = mtu {
        b = b.mtu(m);
    }
    h.link()
        .add(b.up().build())
        .execute()
        .await
        .map_err(nl(format!("create bridge {name}")))?;
    index_of(h, name)
        .await?
        .ok_or_else(|| NetworkError::Netlink {
            what: name.into(),
            message: "bridge vanished after creation".into(),
        })
}

/// Writes only when the value differs: forwarding may already be on (and
/// /proc/sys read-only, as in a container sharing another's network).
pub(crate) fn write_sysctl(path: &str, value: &str) -> Result<(), NetworkError> {
    if std::fs::read_to_string(path).is_ok_and(|v| v.trim() == value) {
        return Ok(());
    }
    std::fs::write(path, value).map_err(|source| NetworkError::Sys {
        what: format!("write {path}"),
        source,
    })
}

/// The host side, once per host: the bridge with the VM subnet's gateway
/// address (and the IPv6 range's, dual-stack), and forwarding (which VMs
/// need to reach beyond the host).
pub fn setup_host(
    gateway: Ipv4Addr,
    prefix: u8,
    v6: Option<(Ipv6Addr, u8)>,
) -> Result<(), NetworkError> {
    if v6.is_some() {
        ipv6_available()?;
    }
    in_netns(None, move |h| {
        Box::pin(async move {
            let i = ensure_bridge(&h, HOST_BRIDGE, None, None).await?;
            add_addr(&h, i, IpAddr::V4(gateway), prefix, HOST_BRIDGE).await?;
            if let Some((gw6, len)) = v6 {
                write_sysctl(&ipv6_conf(HOST_BRIDGE, "disable_ipv6"), "0")?;
                add_addr(&h, i, IpAddr::V6(gw6), len, HOST_BRIDGE).await?;
            }
            h.link()
                .set(rtnetlink::LinkUnspec::new_with_index(i).up().build())
                .execute()
                .await
                .map_err(nl("bring up kvirt0"))?;
            Ok(())
        })
    })?;
    if v6.is_some() {
        write_sysctl("/proc/sys/net/ipv6/conf/all/forwarding", "1")?;
    }
    write_sysctl("/proc/sys/net/ipv4/ip_forward", "1")
}

fn ipv6_conf(iface: &str, key: &str) -> String {
    format!("/proc/sys/net/ipv6/conf/{iface}/{key}")
}

/// A kernel booted with `ipv6.disable=1` has no IPv6 at all: say so
/// rather than fail on the first address.
fn ipv6_available() -> Result<(), NetworkError> {
    if Path::new("/proc/sys/net/ipv6").exists() {
        return Ok(());
    }
    Err(NetworkError::Sys {
        what: "network.subnet6 is set but this kernel has IPv6 disabled".into(),
        source: std::io::Error::from(std::io::ErrorKind::Unsupported),
    })
}

/// A link's index, the index of its peer (a veth's), and whether the peer
/// lives in another namespace.
async fn link_peer(
    h: &rtnetlink::Handle,
    name: &str,
) -> Result<Option<(u32, Option<u32>, bool)>, NetworkError> {
    use futures::TryStreamExt;
    use rtnetlink::packet_route::link::LinkAttribute;
    let mut links = h.link().get().match_name(name.to_owned()).execute();
    let link = match links.try_next().await {
        Ok(Some(l)) => l,
        Ok(None) => return Ok(None),
        Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::ENODEV => return Ok(None),
        Err(e) => return Err(nl(format!("find {name}"))(e)),
    };
    let peer = link.attributes.iter().find_map(|a| match a {
        LinkAttribute::Link(i) => Some(*i),
        _ => None,
    });
    let elsewhere = link
        .attributes
        .iter()
        .any(|a| matches!(a, LinkAttribute::LinkNetNsId(_)));
    Ok(Some((link.header.index, peer, elsewhere)))
}

/// Whether the host's link `host_index`, named `veth`, is this VM's: its
/// peer is the VM's `eth0` (or, half made, its `<veth>p`) in the VM's
/// namespace, or still `<veth>p` beside it. Names are a 48-bit hash of the
/// VM's id: a tenant could find another id of the same name, and must not
/// make kvirt reuse or remove another VM's uplink by it.
fn is_vms_own(vm_netns: &Path, veth: &str, host_index: u32) -> Result<bool, NetworkError> {
    let peer = format!("{veth}p");
    let p = peer.clone();
    let beside = in_netns(None, move |h| {
        Box::pin(async move { link_peer(&h, &p).await })
    })?;
    if let Some((_, Some(i), false)) = beside {
        return Ok(i == host_index);
    }
    if !vm_netns.exists() {
        return Ok(false);
    }
    in_netns(Some(vm_netns.to_owned()), move |h| {
        Box::pin(async move {
            for name in [POD_IFACE, peer.as_str()] {
                if let Some((_, Some(i), true)) = link_peer(&h, name).await? {
                    return Ok(i == host_index);
                }
            }
            Ok(false)
        })
    })
}

/// One VM's network in its (existing) namespace. Idempotent: what exists is
/// kept, so a half-done attempt can be completed; a link of its name that
/// is not its own is refused, never reused.
pub fn setup_vm(n: &VmNetwork) -> Result<(), NetworkError> {
    let plan = n.clone();
    let peer = format!("{}p", &n.host_veth);
    let veth = n.host_veth.clone();
    let existing = in_netns(None, move |h| {
        Box::pin(async move { index_of(&h, &veth).await })
    })?;
    if let Some(i) = existing {
        if !is_vms_own(&n.netns_path, &n.host_veth, i)? {
            return Err(NetworkError::Netlink {
                what: n.host_veth.clone(),
                message: "a link of this name exists and is not this VM's: it is not reused".into(),
            });
        }
    }
    // Host side: the veth pair, host end on kvirt0, peer moved in.
    let (host_veth, peer_name, netns, mtu) = (
        n.host_veth.clone(),
        peer.clone(),
        n.netns_path.clone(),
        n.mtu,
    );
    in_netns(None, move |h| {
        Box::pin(async move {
            if index_of(&h, &host_veth).await?.is_none() {
                h.link()
                    .add(
                        rtnetlink::LinkVeth::new(&host_veth, &peer_name)
                            .mtu(mtu)
                            .build(),
                    )
                    .execute()
                    .await
                    .map_err(nl(format!("create veth {host_veth}")))?;
            }
            let bridge = index_of(&h, HOST_BRIDGE)
                .await?
                .ok_or_else(|| NetworkError::Netlink {
                    what: HOST_BRIDGE.into(),
                    message: "host bridge missing".into(),
                })?;
            let host_i = index_of(&h, &host_veth).await?.unwrap_or_default();
            h.link()
                .set(
                    rtnetlink::LinkUnspec::new_with_index(host_i)
                        .controller(bridge)
                        .up()
                        .build(),
                )
                .execute()
                .await
                .map_err(nl(format!("attach {host_veth} to kvirt0")))?;
            if let Some(p) = index_of(&h, &peer_name).await? {
                let ns = std::fs::File::open(&netns).map_err(|source| NetworkError::Sys {
                    what: format!("open {}", netns.display()),
                    source,
                })?;
                h.link()
                    .set(
                        rtnetlink::LinkUnspec::new_with_index(p)
                            .setns_by_fd(ns.as_raw_fd())
                            .build(),
                    )
                    .execute()
                    .await
                    .map_err(nl(format!("move {peer_name} into the VM namespace")))?;
            }
            Ok(())
        })
    })?;

    // Inside: eth0 with the pod address, k6t-eth0, tap0, forwarding.
    in_netns(Some(n.netns_path.clone()), move |h| {
        Box::pin(async move {
            let n = plan;
            if let Some(p) = index_of(&h, &peer).await? {
                h.link()
                    .set(
                        rtnetlink::LinkUnspec::new_with_index(p)
                            .name(POD_IFACE.to_owned())
                            .build(),
                    )
                    .execute()
                    .await
                    .map_err(nl("rename to eth0"))?;
            }
            let eth0 = index_of(&h, POD_IFACE)
                .await?
                .ok_or_else(|| NetworkError::Netlink {
                    what: POD_IFACE.into(),
                    message: "missing in the VM namespace".into(),
                })?;
            add_addr(&h, eth0, IpAddr::V4(n.pod_ip), n.pod_prefix, POD_IFACE).await?;
            if let Some(v6) = n.pod_v6 {
                add_addr(&h, eth0, IpAddr::V6(v6.ip), v6.prefix, POD_IFACE).await?;
            }
            h.link()
                .set(rtnetlink::LinkUnspec::new_with_index(eth0).up().build())
                .execute()
                .await
                .map_err(nl("bring up eth0"))?;
            let route = rtnetlink::RouteMessageBuilder::<Ipv4Addr>::new()
                .gateway(n.pod_gateway)
                .build();
            ignore_exists(h.route().add(route).execute().await, "default route")?;
            if let Some(v6) = n.pod_v6 {
                let route = rtnetlink::RouteMessageBuilder::<Ipv6Addr>::new()
                    .output_interface(eth0)
                    .gateway(v6.gateway)
                    .build();
                ignore_exists(h.route().add(route).execute().await, "IPv6 default route")?;
                write_sysctl("/proc/sys/net/ipv6/conf/all/forwarding", "1")?;
            }
            let br = ensure_bridge(&h, VM_BRIDGE, Some(VM_BRIDGE_MAC), Some(n.mtu)).await?;
            add_addr(&h, br, IpAddr::V4(n.vm_gateway), n.vm_prefix, VM_BRIDGE).await?;
            if n.pod_v6.is_some() {
                let prefix = crate::core::dhcp6::PREFIX;
                add_addr(&h, br, IpAddr::V6(VM_GATEWAY6), prefix, VM_BRIDGE).await?;
            }
            if index_of(&h, TAP).await?.is_none() {
                create_tap(TAP, n.tap_uid, n.tap_gid)?;
            }
            let tap = index_of(&h, TAP).await?.unwrap_or_default();
            h.link()
                .set(
                    rtnetlink::LinkUnspec::new_with_index(tap)
                        .controller(br)
                        .mtu(n.mtu)
                        .up()
                        .build(),
                )
                .execute()
                .await
                .map_err(nl("attach tap0"))?;
            write_sysctl("/proc/sys/net/ipv4/ip_forward", "1")?;
            Ok(())
        })
    })
}

fn ignore_exists(r: Result<(), rtnetlink::Error>, what: &str) -> Result<(), NetworkError> {
    match r {
        Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::EEXIST => Ok(()),
        r => r.map_err(nl(what)),
    }
}

/// The host end of the VM's veth, when there is one and it is this VM's
/// (see [`is_vms_own`]): what [`teardown_vm`] deletes. A link of that name
/// that is not this VM's is left alone. Run before the VM's namespace goes.
pub fn own_veth(host_veth: &str, vm_netns: &Path) -> Result<Option<u32>, NetworkError> {
    let name = host_veth.to_owned();
    let found = in_netns(None, move |h| {
        Box::pin(async move { index_of(&h, &name).await })
    })?;
    let Some(i) = found else {
        return Ok(None);
    };
    if !is_vms_own(vm_netns, host_veth, i)? {
        tracing::warn!("{host_veth} is not this VM's link: left alone");
        return Ok(None);
    }
    Ok(Some(i))
}

/// Removes the host end of the veth (its peer goes with it), now, alone;
/// a missing one is fine. The loop deletes through a
/// [`LinkReaper`](crate::host::linkreap::LinkReaper), which batches.
pub fn teardown_vm(host_veth: &str, vm_netns: &Path) -> Result<(), NetworkError> {
    use crate::host::linkreap::{Doomed, Netlink, Unlink};
    let Some(index) = own_veth(host_veth, vm_netns)? else {
        return Ok(());
    };
    let link = Doomed {
        index,
        name: host_veth.to_owned(),
    };
    Netlink
        .unlink(&[link])
        .remove(0)
        .map_err(|message| NetworkError::Netlink {
            what: format!("delete {host_veth}"),
            message,
        })
}

/// Whether the host end of a VM's veth exists (observation for adoption).
pub fn veth_exists(host_veth: &str) -> bool {
    Path::new("/sys/class/net").join(host_veth).exists()
}

/// A VM's networks as the loop sees it: made, re-attached after a
/// restart, removed. The real adapter is [`HostNetwork`]; `fake` has a
/// recording one.
pub trait Network: Send + Sync + 'static {
    /// Makes the VM's networks (idempotent): the pod network (its address
    /// leased), then each secondary network (attached by its CNI plugins,
    /// bound to a bridge, served by DHCP). `tap_owner` is the VM's identity
    /// (uid, gid): QEMU opens the taps.
    fn setup(
        &self,
        id: &str,
        vm: VmMeta<'_>,
        pod: Option<&NetSpec>,
        secondary: &[Attached],
        tap_owner: (u32, u32),
    ) -> impl std::future::Future<Output = Result<(), NetworkError>> + Send;
    /// Re-attaches what lives in kvirtd itself (the DHCP servers) to a
    /// running VM, e.g. after a restart; a no-op when attached.
    fn attach(
        &self,
        id: &str,
        pod: Option<&NetSpec>,
        secondary: &[Secondary],
    ) -> impl std::future::Future<Output = Result<(), NetworkError>> + Send;
    /// Removes everything of the VM's networks (each CNI attachment
    /// deleted, the address released); continues past errors and reports
    /// them all.
    fn teardown(
        &self,
        id: &str,
    ) -> impl std::future::Future<Output = Result<(), NetworkError>> + Send;
    /// The pod network's address (the VMI's `ipAddress`, as KubeVirt
    /// reports the pod IP).
    fn address(&self, id: &str) -> Option<Ipv4Addr>;
    /// The pod network's IPv6 address, dual-stack.
    fn address6(&self, _id: &str) -> Option<Ipv6Addr> {
        None
    }
    /// Whether anything of the VM's networks is held (an address, a CNI
    /// attachment).
    fn holds(&self, id: &str) -> bool {
        self.address(id).is_some()
    }
    /// Ids holding an address or an attachment (for cleaning up after VMIs
    /// that are gone).
    fn ids(&self) -> Vec<String>;
    /// The secondary networks' plugin results, by interface (`pod<hash>`).
    fn attachments(&self, _id: &str) -> Vec<(String, crate::core::cni::CniResult)> {
        Vec::new()
    }
    /// The CNI config directory's network of this name (a
    /// NetworkAttachmentDefinition without a config names one).
    fn named_config(&self, _name: &str) -> Option<String> {
        None
    }
}

/// Host-wide network settings, from the config.
#[derive(Clone, Debug)]
pub struct NetworkSettings {
    /// How CNI plugins are run, and where they are recorded.
    pub cni: crate::host::cni::ExecCni,
    /// Where named CNI network configs are (`/etc/cni/net.d`).
    pub cni_config_dir: PathBuf,
    pub subnet: crate::core::ipam::Subnet,
    /// Dual stack: the IPv6 range paired with `subnet`.
    pub subnet6: Option<crate::core::ipam::Subnet6>,
    pub mtu: u32,
    pub dns: Vec<Ipv4Addr>,
    pub dhcp_lease_secs: u32,
    pub netns_dir: PathBuf,
}

pub struct HostNetwork {
    settings: NetworkSettings,
    secondary: SecondaryNets,
    ipam: std::sync::Arc<crate::host::ipam::Ipam>,
    dhcp: crate::host::dhcp::DhcpServers,
    host_table: nft::HostTable,
    veths: crate::host::linkreap::LinkReaper,
}

fn vm_err(id: &str) -> impl FnOnce(String) -> NetworkError + '_ {
    move |message| NetworkError::Vm {
        id: id.into(),
        message,
    }
}

async fn blocking<T: Send + 'static>(
    id: &str,
    f: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> Result<T, NetworkError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|_| NetworkError::Thread)?
        .map_err(vm_err(id))
}

impl HostNetwork {
    /// Opens the lease store and makes the host side (bridge, forwarding,
    /// egress NAT); leases the store had to drop are returned for logging.
    /// Needs a tokio runtime (the host table's worker is a task).
    pub fn start(
        settings: NetworkSettings,
        lease_file: PathBuf,
    ) -> Result<(Self, Vec<String>), NetworkError> {
        let err = |message: String| NetworkError::Vm {
            id: "host".into(),
            message,
        };
        if let Some(dir) = lease_file.parent() {
            std::fs::create_dir_all(dir).map_err(|e| err(e.to_string()))?;
        }
        let (ipam, dropped) = crate::host::ipam::Ipam::open(
            crate::host::ipam::LeaseFile::new(lease_file),
            settings.subnet,
        )
        .map_err(|e| err(e.to_string()))?;
        let v4 = settings.subnet;
        let v6 = settings.subnet6.map(|s| (s.network(), s.prefix()));
        let gw6 = settings.subnet6.map(|s| (s.gateway(&v4), s.prefix()));
        setup_host(v4.gateway(), v4.prefix(), gw6)?;
        // Every VM holding an address may send from it, running or adopted.
        let sources: Vec<VmSource> = ipam
            .snapshot()
            .iter()
            .map(|(id, lease)| vm_source(&settings, id, lease.ip))
            .collect();
        nft::apply(&rules::host_ruleset(&v4, v6, HOST_BRIDGE, &sources), None)
            .map_err(|e| err(e.to_string()))?;
        let (secondary, unreadable) = SecondaryNets::open(settings.cni.clone());
        let mut dropped: Vec<String> = dropped.iter().map(|d| d.to_string()).collect();
        dropped.extend(unreadable);
        Ok((
            Self {
                settings,
                secondary,
                ipam: std::sync::Arc::new(ipam),
                dhcp: crate::host::dhcp::DhcpServers::new(),
                host_table: nft::HostTable::start(None),
                veths: crate::host::linkreap::LinkReaper::default(),
            },
            dropped,
        ))
    }

    fn netns_path(&self, id: &str) -> PathBuf {
        self.settings
            .netns_dir
            .join(crate::core::key::netns_name_of(id))
    }

    fn lease_config(&self, net: &NetSpec) -> crate::core::dhcp::LeaseConfig {
        let mut l = crate::core::dhcp::LeaseConfig::masquerade(
            net.mac,
            self.settings.dns.clone(),
            self.settings.mtu as u16,
        );
        l.ip = net.guest_ip();
        l.router = net.vm_gateway();
        l.server_id = net.vm_gateway();
        l.netmask = Ipv4Addr::from(u32::MAX << (32 - net.vm_cidr.1));
        l.lease_secs = self.settings.dhcp_lease_secs;
        l.hostname = Some(net.hostname.chars().take(63).collect());
        l.domain_search = net.domain_search.clone();
        l
    }
}

/// What a VM's veth may send from: its lease, and the IPv6 address
/// paired with it when dual-stack.
fn vm_source(settings: &NetworkSettings, id: &str, ip: Ipv4Addr) -> VmSource {
    VmSource {
        veth: host_veth_name(id),
        ip,
        ip6: settings
            .subnet6
            .map(|s6| s6.address_of(&settings.subnet, ip)),
    }
}

impl HostNetwork {
    fn lease_defaults(&self, hostname: &str) -> LeaseDefaults {
        LeaseDefaults {
            dns: self.settings.dns.clone(),
            lease_secs: self.settings.dhcp_lease_secs,
            hostname: hostname.to_owned(),
        }
    }

    async fn setup_pod(
        &self,
        id: &str,
        uid: &str,
        net: &NetSpec,
        tap_owner: (u32, u32),
    ) -> Result<(), NetworkError> {
        let ipam = self.ipam.clone();
        let (i, u) = (id.to_owned(), uid.to_owned());
        let ip = blocking(id, move || ipam.lease(&i, &u).map_err(|e| e.to_string())).await?;
        self.host_table
            .apply(rules::vm_source_add(&vm_source(&self.settings, id, ip)))
            .await
            .map_err(|e| vm_err(id)(e.to_string()))?;
        let vm = VmNetwork {
            netns_path: self.netns_path(id),
            host_veth: host_veth_name(id),
            pod_ip: ip,
            pod_prefix: self.settings.subnet.prefix(),
            pod_gateway: self.settings.subnet.gateway(),
            pod_v6: self.settings.subnet6.map(|s6| PodV6 {
                ip: s6.address_of(&self.settings.subnet, ip),
                prefix: s6.prefix(),
                gateway: s6.gateway(&self.settings.subnet),
            }),
            mtu: self.settings.mtu,
            vm_gateway: net.vm_gateway(),
            vm_prefix: net.vm_cidr.1,
            tap_uid: tap_owner.0,
            tap_gid: tap_owner.1,
        };
        blocking(id, move || setup_vm(&vm).map_err(|e| e.to_string())).await?;
        let guest = rules::Guest {
            tap: TAP,
            mac: net.mac,
            ip: net.guest_ip(),
            net: net.vm_cidr,
            v6: self.settings.subnet6.map(|_| {
                use crate::core::dhcp6;
                (dhcp6::GUEST, (dhcp6::GUEST_NET, dhcp6::PREFIX))
            }),
        };
        let rules = rules::vm_ruleset(&guest, &net.ports);
        let netns = crate::core::key::netns_name_of(id);
        if self.settings.netns_dir == Path::new(crate::host::netns::NETNS_DIR) {
            blocking(id, move || {
                nft::apply(&rules, Some(&netns)).map_err(|e| e.to_string())
            })
            .await?;
        }
        self.attach_pod(id, net).await
    }

    /// Serves the guest's leases: DHCP, and DHCPv6 when dual-stack. Each
    /// server that runs already is kept.
    async fn attach_pod(&self, id: &str, net: &NetSpec) -> Result<(), NetworkError> {
        let netns = self.netns_path(id);
        if !self.dhcp.serves(id) {
            let lease = self.lease_config(net);
            self.dhcp
                .start(id, &netns, VM_BRIDGE, lease)
                .await
                .map_err(|e| vm_err(id)(e.to_string()))?;
        }
        let key = dhcp6_key(id);
        if self.settings.subnet6.is_some() && !self.dhcp.serves(&key) {
            let lease = crate::core::dhcp6::Lease6::masquerade(
                VM_BRIDGE_MAC,
                Vec::new(),
                self.settings.dhcp_lease_secs,
            );
            self.dhcp
                .start(&key, &netns, VM_BRIDGE, lease)
                .await
                .map_err(|e| vm_err(id)(e.to_string()))?;
        }
        Ok(())
    }
}

/// The pod network's DHCPv6 server's key (the DHCP server's is the id).
fn dhcp6_key(id: &str) -> String {
    format!("{id}#v6")
}

impl Network for HostNetwork {
    async fn setup(
        &self,
        id: &str,
        vm: VmMeta<'_>,
        pod: Option<&NetSpec>,
        secondary: &[Attached],
        tap_owner: (u32, u32),
    ) -> Result<(), NetworkError> {
        if let Some(net) = pod {
            self.setup_pod(id, vm.uid, net, tap_owner).await?;
        }
        if secondary.is_empty() {
            return Ok(());
        }
        let defaults = self.lease_defaults(vm.hostname);
        self.secondary
            .setup(
                id,
                vm,
                &self.netns_path(id),
                secondary,
                tap_owner,
                &self.dhcp,
                &defaults,
            )
            .await
    }

    async fn attach(
        &self,
        id: &str,
        pod: Option<&NetSpec>,
        secondary: &[Secondary],
    ) -> Result<(), NetworkError> {
        if let Some(net) = pod {
            self.attach_pod(id, net).await?;
        }
        if secondary.is_empty() {
            return Ok(());
        }
        let hostname = pod.map_or(id, |p| p.hostname.as_str());
        let defaults = self.lease_defaults(hostname);
        self.secondary
            .attach(id, &self.netns_path(id), secondary, &self.dhcp, &defaults)
            .await
    }

    async fn teardown(&self, id: &str) -> Result<(), NetworkError> {
        // The plugins first: they find what they made in the namespace.
        let mut errors = self.secondary.teardown(id, &self.dhcp).await;
        self.dhcp.stop(id).await;
        self.dhcp.stop(&dhcp6_key(id)).await;
        let (veth, netns) = (host_veth_name(id), self.netns_path(id));
        let name = veth.clone();
        match blocking(id, move || {
            own_veth(&veth, &netns).map_err(|e| e.to_string())
        })
        .await
        {
            Ok(Some(index)) => {
                let link = crate::host::linkreap::Doomed { index, name };
                if let Err(e) = self.veths.delete(link).await {
                    errors.push(e);
                }
            }
            Ok(None) => {}
            Err(e) => errors.push(e.to_string()),
        }
        if let Some(lease) = self.ipam.get(id) {
            let source = rules::vm_source_remove(&vm_source(&self.settings, id, lease.ip));
            if let Err(e) = self.host_table.apply(source).await {
                errors.push(e.to_string());
            }
        }
        let ipam = self.ipam.clone();
        let i = id.to_owned();
        if let Err(e) = blocking(id, move || {
            ipam.release(&i).map(|_| ()).map_err(|e| e.to_string())
        })
        .await
        {
            errors.push(e.to_string());
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(vm_err(id)(errors.join("; ")))
        }
    }

    fn address(&self, id: &str) -> Option<Ipv4Addr> {
        self.ipam.get(id).map(|l| l.ip)
    }

    fn address6(&self, id: &str) -> Option<Ipv6Addr> {
        let s6 = self.settings.subnet6?;
        Some(s6.address_of(&self.settings.subnet, self.address(id)?))
    }

    fn holds(&self, id: &str) -> bool {
        self.address(id).is_some() || self.secondary.holds(id)
    }

    fn ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.ipam.snapshot().ids().map(str::to_owned).collect();
        ids.extend(self.secondary.ids());
        ids.sort();
        ids.dedup();
        ids
    }

    fn attachments(&self, id: &str) -> Vec<(String, crate::core::cni::CniResult)> {
        self.secondary.results_of(id)
    }

    fn named_config(&self, name: &str) -> Option<String> {
        SecondaryNets::named_config(&self.settings.cni_config_dir, name)
    }
}

// rtnetlink cannot create taps (EOPNOTSUPP): the tun driver's ioctls can.
nix::ioctl_write_int!(tunsetiff, b'T', 202);
nix::ioctl_write_int!(tunsetpersist, b'T', 203);
nix::ioctl_write_int!(tunsetowner, b'T', 204);
nix::ioctl_write_int!(tunsetgroup, b'T', 206);

#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// A persistent tap owned by the VM's user, so its unprivileged QEMU can
/// open it (`managed='no'`).
pub(crate) fn create_tap(name: &str, uid: u32, gid: u32) -> Result<(), NetworkError> {
    let sys = |what: &str| {
        let what = format!("{what} {name}");
        move |e: nix::Error| NetworkError::Sys {
            what,
            source: e.into(),
        }
    };
    let tun = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
        .map_err(|source| NetworkError::Sys {
            what: "open /dev/net/tun".into(),
            source,
        })?;
    let mut req = IfReq {
        name: [0; libc::IFNAMSIZ],
        flags: (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as libc::c_short,
        _pad: [0; 22],
    };
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    let fd = tun.as_raw_fd();
    // SAFETY: the ioctls get the fd of /dev/net/tun and a valid ifreq or int.
    unsafe {
        tunsetiff(fd, &req as *const IfReq as u64).map_err(sys("TUNSETIFF"))?;
        tunsetowner(fd, uid as u64).map_err(sys("TUNSETOWNER"))?;
        tunsetgroup(fd, gid as u64).map_err(sys("TUNSETGROUP"))?;
        tunsetpersist(fd, 1).map_err(sys("TUNSETPERSIST"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::netns::{KernelNetns, Netns};

    fn ip_json(netns: &Path, args: &str) -> serde_json::Value {
        let out = std::process::Command::new("nsenter")
            .arg(format!("--net={}", netns.display()))
            .args(["ip", "-j"])
            .args(args.split(' '))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }

    fn has_addr(v: &serde_json::Value, ifname: &str, ip: &str) -> bool {
        v.as_array().unwrap().iter().any(|l| {
            l["ifname"] == ifname
                && l["addr_info"]
                    .as_array()
                    .is_some_and(|a| a.iter().any(|x| x["local"] == ip))
        })
    }

    /// A VM `id`'s network in namespace `netns`, at 10.213.0.`ip`, its tap
    /// nobody's.
    fn test_vm(netns: PathBuf, id: &str, ip: u8) -> VmNetwork {
        VmNetwork {
            netns_path: netns,
            host_veth: host_veth_name(id),
            pod_ip: Ipv4Addr::new(10, 213, 0, ip),
            pod_prefix: 24,
            pod_gateway: Ipv4Addr::new(10, 213, 0, 1),
            pod_v6: None,
            mtu: 1500,
            vm_gateway: VM_GATEWAY,
            vm_prefix: VM_PREFIX,
            tap_uid: 65534,
            tap_gid: 65534,
        }
    }

    /// Tier 2: the whole plumbing for real, in two throwaway namespaces (one
    /// standing in for the host), twice to show it is idempotent.
    #[tokio::test]
    async fn plumbs_a_vm_network_in_throwaway_namespaces() {
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("skipped: needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let ns = KernelNetns::at(dir.path());
        let (host, vm) = ("kvirt-t-host", "kvirt-t-vm");
        ns.create(host).await.unwrap();
        ns.create(vm).await.unwrap();
        let (hp, vp) = (dir.path().join(host), dir.path().join(vm));
        // Dual stack, so both families are plumbed.
        let n = VmNetwork {
            pod_v6: Some(PodV6 {
                ip: "fd00:6b76::2".parse().unwrap(),
                prefix: 64,
                gateway: "fd00:6b76::1".parse().unwrap(),
            }),
            ..test_vm(vp.clone(), "t_vm", 2)
        };
        let hp2 = hp.clone();
        let n2 = n.clone();
        let result = std::thread::spawn(move || {
            // Threads spawned from here inherit this stand-in host namespace.
            let f = std::fs::File::open(&hp2).unwrap();
            setns(f.as_fd(), CloneFlags::CLONE_NEWNET).unwrap();
            let gw6 = n2.pod_v6.map(|v| (v.gateway, v.prefix));
            for _ in 0..2 {
                setup_host(n2.pod_gateway, n2.pod_prefix, gw6)?;
                setup_vm(&n2)?;
            }
            Ok::<_, NetworkError>(())
        })
        .join()
        .unwrap();
        let inside = ip_json(&vp, "addr");
        let host_side = ip_json(&hp, "addr");
        let routes = ip_json(&vp, "route");
        let routes6 = ip_json(&vp, "-6 route");
        let tap = ip_json(&vp, "-d link show tap0");
        ns.delete(vm).await.unwrap();
        ns.delete(host).await.unwrap();
        result.unwrap();
        assert!(has_addr(&inside, "eth0", "10.213.0.2"), "{inside}");
        assert!(has_addr(&inside, "k6t-eth0", "10.0.2.1"), "{inside}");
        assert!(has_addr(&host_side, "kvirt0", "10.213.0.1"), "{host_side}");
        assert!(has_addr(&inside, "eth0", "fd00:6b76::2"), "{inside}");
        assert!(has_addr(&inside, "k6t-eth0", "fd10:0:2::1"), "{inside}");
        assert!(
            has_addr(&host_side, "kvirt0", "fd00:6b76::1"),
            "{host_side}"
        );
        // Usable at once: no duplicate detection holding them tentative.
        let tentative = inside
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|l| l["addr_info"].as_array().unwrap().iter())
            .filter(|a| a["local"].as_str().is_some_and(|l| !l.starts_with("fe80")))
            .any(|a| a.get("tentative").is_some());
        assert!(!tentative, "{inside}");
        assert!(
            routes6
                .as_array()
                .unwrap()
                .iter()
                .any(|r| r["dst"] == "default" && r["gateway"] == "fd00:6b76::1"),
            "{routes6}"
        );
        assert!(
            routes
                .as_array()
                .unwrap()
                .iter()
                .any(|r| r["dst"] == "default" && r["gateway"] == "10.213.0.1"),
            "{routes}"
        );
        assert_eq!(tap[0]["master"], "k6t-eth0", "{tap}");
        // QEMU, running as the VM's user, opens the persistent tap it owns.
        let tun = &tap[0]["linkinfo"]["info_data"];
        assert_eq!(tun["type"], "tap", "{tap}");
        // `ip` names the owner when the user database has it.
        assert!(
            matches!(tun["user"].as_str(), Some("nobody")) || tun["user"] == 65534,
            "{tap}"
        );
        assert!(
            tun["group"]
                .as_str()
                .is_some_and(|g| g == "nogroup" || g == "nobody")
                || tun["group"] == 65534,
            "{tap}"
        );
    }

    /// Tier 2: two VMs whose ids give the same link name (a tenant found
    /// one): the second is refused rather than handed the first's uplink,
    /// and tearing it down leaves the first's alone.
    #[tokio::test]
    async fn a_link_of_another_vm_is_never_reused_or_removed() {
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("skipped: needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let ns = KernelNetns::at(dir.path());
        let (host, a, b) = ("kvirt-tc-host", "kvirt-tc-a", "kvirt-tc-b");
        for n in [host, a, b] {
            ns.create(n).await.unwrap();
        }
        let vm = |netns: &str, ip: u8| test_vm(dir.path().join(netns), "t_same", ip);
        let (va, vb) = (vm(a, 2), vm(b, 3));
        let hp = dir.path().join(host);
        let result = std::thread::spawn(move || {
            let f = std::fs::File::open(&hp).unwrap();
            setns(f.as_fd(), CloneFlags::CLONE_NEWNET).unwrap();
            setup_host(va.pod_gateway, va.pod_prefix, None).unwrap();
            setup_vm(&va).unwrap();
            setup_vm(&va).expect("its own link is reused");
            let refused = setup_vm(&vb).expect_err("another VM's link");
            teardown_vm(&vb.host_veth, &vb.netns_path).unwrap();
            let after_b = index_exists(&va.host_veth);
            teardown_vm(&va.host_veth, &va.netns_path).unwrap();
            (refused.to_string(), after_b, index_exists(&va.host_veth))
        })
        .join();
        for n in [a, b, host] {
            ns.delete(n).await.unwrap();
        }
        let (refused, after_b, after_a) = result.unwrap();
        assert!(refused.contains("is not this VM's"), "{refused}");
        assert!(after_b, "B's teardown left A's uplink");
        assert!(!after_a, "A's own teardown removed it");
    }

    /// Whether a link of that name is in this thread's namespace.
    fn index_exists(name: &str) -> bool {
        let name = name.to_owned();
        in_netns(None, move |h| {
            Box::pin(async move { index_of(&h, &name).await })
        })
        .unwrap()
        .is_some()
    }

    #[test]
    fn veth_names_fit_and_are_stable() {
        let v = host_veth_name(&"x".repeat(250));
        assert!(v.len() <= 15, "{v}");
        assert!(format!("{v}p").len() <= 15);
        assert_eq!(v, host_veth_name(&"x".repeat(250)));
        assert_ne!(host_veth_name("a_b"), host_veth_name("a_c"));
        assert!(is_host_veth_name(&v));
        for other in ["kvirt0", "eth0", "kv0123456789ag", "kv0123456789abc"] {
            assert!(!is_host_veth_name(other), "{other}");
        }
    }
}
