//! Secondary networks as a container runtime drives CNI plugins for a pod,
//! pure: a NetworkAttachmentDefinition's config resolved by Multus's rules,
//! what each plugin is given (the CNI spec's environment, libcni's stdin),
//! what it answers, the record libcni keeps of each attachment (so DEL gets
//! the config ADD used, also after a crash), and what Multus reports.
//! Running the plugins is `host::cni`'s.

use crate::core::key::is_dns_subdomain;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

/// The spec versions kvirt speaks (Debian's plugins speak 0.1.0–1.0.0).
pub const VERSIONS: &[&str] = &["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];
/// A config or a plugin's answer larger than this is no network's.
pub const MAX_BYTES: usize = 256 * 1024;
/// The annotation Multus writes on a pod with what each network attached.
pub const NETWORK_STATUS_ANNOTATION: &str = "k8s.v1.cni.cncf.io/network-status";
/// The pod network's name in it.
pub const POD_NETWORK_NAME: &str = "kvirt-pod-network";
/// libcni's cache record kind.
pub const CACHE_KIND: &str = "cniCacheV1";
/// Set in `CNI_ARGS` by kvirt (plugins ignore it: `IgnoreUnknown`): a
/// record carrying it is kvirt's, and names its VM.
pub const VM_ARG: &str = "KVIRT_VM";

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CniError {
    #[error("network {network}: {message}")]
    Config { network: String, message: String },
    #[error("{plugin}: {message}")]
    Plugin { plugin: String, message: String },
    #[error("CNI record {file}: {message}")]
    Record { file: String, message: String },
}

fn config_err(network: &str, message: impl Into<String>) -> CniError {
    CniError::Config {
        network: network.into(),
        message: message.into(),
    }
}

/// A NetworkAttachmentDefinition's reference, `[namespace/]name`: in the
/// VMI's namespace unless it names another (as Multus reads it).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NetworkRef {
    pub namespace: String,
    pub name: String,
}

impl NetworkRef {
    pub fn parse(s: &str, vmi_namespace: &str) -> Result<Self, String> {
        let (ns, name) = s.split_once('/').unwrap_or((vmi_namespace, s));
        for part in [ns, name] {
            if !is_dns_subdomain(part) {
                return Err(format!(
                    "{s:?}: expected [namespace/]name (lower-case DNS names)"
                ));
            }
        }
        Ok(Self {
            namespace: ns.into(),
            name: name.into(),
        })
    }
}

impl std::fmt::Display for NetworkRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// libcni's rule for network names (they name cache files).
fn is_network_name(s: &str) -> bool {
    let mut b = s.bytes();
    b.next().is_some_and(|c| c.is_ascii_alphanumeric())
        && b.all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'-'))
        && s.len() <= 253
}

/// A plugin is found by its bare file name in the plugin directories:
/// never a path, never hidden.
fn is_plugin_type(s: &str) -> bool {
    let mut b = s.bytes();
    s.len() <= 64
        && b.next().is_some_and(|c| c.is_ascii_alphanumeric())
        && b.all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'-'))
        && !s.contains("..")
}

/// A network configuration list, as libcni loads one: a single plugin's
/// config becomes a list of one.
#[derive(Clone, Debug, PartialEq)]
pub struct ConfList {
    pub name: String,
    pub cni_version: String,
    pub plugins: Vec<Map<String, Value>>,
    /// The list's JSON as recorded and given back to DEL.
    pub bytes: Vec<u8>,
}

impl ConfList {
    /// The plugins' types, in order (for messages).
    pub fn types(&self) -> Vec<&str> {
        self.plugins
            .iter()
            .map(|p| p["type"].as_str().unwrap_or(""))
            .collect()
    }

    /// Reads a list back from the bytes of a record (checked as anew:
    /// records live where the VM's user cannot write, but a bad one must
    /// still not run anything strange).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, CniError> {
        let v: Value = serde_json::from_slice(bytes)
            .map_err(|e| config_err("(recorded)", format!("not JSON: {e}")))?;
        let name = v["name"].as_str().unwrap_or("(recorded)").to_owned();
        list_of(&name, v)
    }
}

/// Resolves a NetworkAttachmentDefinition's `spec.config` as Multus does:
/// a list (`plugins`) or one plugin's config (wrapped into a list), its
/// `name` injected when missing. An empty config means the file of that
/// name in the CNI config directory; the caller reads it and passes it
/// as `config`.
pub fn resolve(nad_name: &str, config: &str) -> Result<ConfList, CniError> {
    if config.len() > MAX_BYTES {
        return Err(config_err(
            nad_name,
            format!("config of {} bytes (at most {MAX_BYTES})", config.len()),
        ));
    }
    let mut v: Value = serde_json::from_str(config)
        .map_err(|e| config_err(nad_name, format!("spec.config is not JSON: {e}")))?;
    let Some(o) = v.as_object_mut() else {
        return Err(config_err(nad_name, "spec.config is not a JSON object"));
    };
    o.entry("name").or_insert_with(|| nad_name.into());
    if !o.contains_key("plugins") {
        let version = o.get("cniVersion").cloned().unwrap_or(Value::Null);
        let name = o["name"].clone();
        v = json!({"cniVersion": version, "name": name, "plugins": [v]});
    }
    list_of(nad_name, v)
}

fn list_of(network: &str, v: Value) -> Result<ConfList, CniError> {
    let err = |m: String| config_err(network, m);
    let name = match v.get("name") {
        Some(Value::String(n)) if is_network_name(n) => n.clone(),
        Some(n) => return Err(err(format!("name {n} is not a CNI network name"))),
        None => return Err(err("name is missing".into())),
    };
    let cni_version = match v.get("cniVersion").and_then(Value::as_str) {
        Some(ver) if VERSIONS.contains(&ver) => ver.to_owned(),
        Some(ver) => {
            return Err(err(format!(
                "cniVersion {ver:?} is not one kvirt speaks ({VERSIONS:?})"
            )))
        }
        None => return Err(err("cniVersion is missing".into())),
    };
    let plugins: Vec<Map<String, Value>> = match v.get("plugins") {
        Some(Value::Array(ps)) if !ps.is_empty() => ps
            .iter()
            .enumerate()
            .map(|(i, p)| match p {
                Value::Object(o) => match o.get("type").and_then(Value::as_str) {
                    Some(t) if is_plugin_type(t) => Ok(o.clone()),
                    Some(t) => Err(err(format!(
                        "plugins[{i}].type {t:?} is not a plugin's file name"
                    ))),
                    None => Err(err(format!("plugins[{i}].type is missing"))),
                },
                _ => Err(err(format!("plugins[{i}] is not an object"))),
            })
            .collect::<Result<_, _>>()?,
        _ => return Err(err("plugins is not a list of plugin configs".into())),
    };
    let bytes = serde_json::to_vec(&v).map_err(|e| err(e.to_string()))?;
    Ok(ConfList {
        name,
        cni_version,
        plugins,
        bytes,
    })
}

/// KubeVirt's name for the pod interface of a secondary network: `pod`
/// and 11 hex digits of the network name's SHA-256 (15 bytes with `-nic`).
pub fn pod_iface_name(network: &str) -> String {
    let h = Sha256::digest(network.as_bytes());
    let hex: String = h.iter().map(|b| format!("{b:02x}")).collect();
    format!("pod{}", &hex[..11])
}

/// The names KubeVirt's bridge binding gives the links of one network
/// inside the VM's namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BridgeLinks {
    /// The plugin's interface (`CNI_IFNAME`); after the binding a dummy of
    /// this name keeps the plugin's addresses, so CHECK still passes.
    pub pod_iface: String,
    /// The plugin's interface once renamed and enslaved: `<hash>-nic`.
    pub nic: String,
    pub bridge: String,
    pub tap: String,
}

impl BridgeLinks {
    pub fn of(network: &str) -> Self {
        let pod_iface = pod_iface_name(network);
        let hash = &pod_iface[3..];
        Self {
            nic: format!("{hash}-nic"),
            bridge: format!("k6t-{hash}"),
            tap: format!("tap{hash}"),
            pod_iface,
        }
    }
}

/// One attachment's runtime arguments (libcni's RuntimeConf).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Runtime {
    pub container_id: String,
    pub netns: String,
    pub ifname: String,
    /// `CNI_ARGS`, in order.
    pub args: Vec<[String; 2]>,
    /// Offered to plugins that declare the capability (`runtimeConfig`).
    pub capability_args: Map<String, Value>,
}

impl Runtime {
    /// Multus's `CNI_ARGS` for a pod, with the VMI in the pod's place,
    /// and kvirt's own mark naming the VM.
    pub fn for_vmi(
        namespace: &str,
        name: &str,
        uid: &str,
        vm_id: &str,
        netns: &str,
        ifname: &str,
    ) -> Self {
        let arg = |k: &str, v: &str| [k.to_owned(), v.to_owned()];
        Self {
            container_id: uid.into(),
            netns: netns.into(),
            ifname: ifname.into(),
            args: vec![
                arg("IgnoreUnknown", "true"),
                arg("K8S_POD_NAMESPACE", namespace),
                arg("K8S_POD_NAME", name),
                arg("K8S_POD_INFRA_CONTAINER_ID", uid),
                arg("K8S_POD_UID", uid),
                arg(VM_ARG, vm_id),
            ],
            capability_args: Map::new(),
        }
    }

    /// The VM a record of kvirt's names.
    pub fn vm_id(&self) -> Option<&str> {
        self.args
            .iter()
            .find(|[k, _]| k == VM_ARG)
            .map(|[_, v]| v.as_str())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    Add,
    Del,
    Check,
}

impl Command {
    pub fn as_str(self) -> &'static str {
        match self {
            Command::Add => "ADD",
            Command::Del => "DEL",
            Command::Check => "CHECK",
        }
    }
}

/// The environment of one plugin run (the CNI spec's variables; `PATH` for
/// the tools some plugins call). Nothing else of kvirtd's is passed on.
pub fn env(command: Command, rt: &Runtime, cni_path: &str) -> Vec<(&'static str, String)> {
    let args: Vec<String> = rt.args.iter().map(|[k, v]| format!("{k}={v}")).collect();
    vec![
        ("CNI_COMMAND", command.as_str().into()),
        ("CNI_CONTAINERID", rt.container_id.clone()),
        ("CNI_NETNS", rt.netns.clone()),
        ("CNI_IFNAME", rt.ifname.clone()),
        ("CNI_ARGS", args.join(";")),
        ("CNI_PATH", cni_path.into()),
        ("PATH", "/usr/sbin:/usr/bin:/sbin:/bin".into()),
    ]
}

/// What plugin `i` of the list reads on stdin, as libcni builds it: the
/// list's name and version, the previous result, and the runtime's
/// capability arguments the plugin declares.
pub fn plugin_stdin(list: &ConfList, i: usize, prev: Option<&Value>, rt: &Runtime) -> Vec<u8> {
    let mut conf = list.plugins[i].clone();
    conf.insert("name".into(), list.name.clone().into());
    conf.insert("cniVersion".into(), list.cni_version.clone().into());
    if let Some(p) = prev {
        conf.insert("prevResult".into(), p.clone());
    }
    let declared: Vec<String> = conf
        .get("capabilities")
        .and_then(Value::as_object)
        .map(|c| {
            c.iter()
                .filter(|(_, on)| on.as_bool() == Some(true))
                .map(|(k, _)| k.clone())
                .collect()
        })
        .unwrap_or_default();
    let rc: Map<String, Value> = rt
        .capability_args
        .iter()
        .filter(|(k, _)| declared.contains(k))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    if !rc.is_empty() {
        conf.insert("runtimeConfig".into(), Value::Object(rc));
    }
    serde_json::to_vec(&conf).unwrap_or_default()
}

/// DEL gets the recorded result as `prevResult` from spec 0.4.0 on.
pub fn del_gets_prev_result(version: &str) -> bool {
    !version.starts_with("0.3.") && version != "0.1.0" && version != "0.2.0"
}

/// A plugin's result, read into what kvirt uses (spec 0.3.0–1.1.0; a
/// 0.3/0.4 address's `version` is ignored).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CniResult {
    #[serde(default)]
    pub interfaces: Vec<ResultIface>,
    #[serde(default)]
    pub ips: Vec<ResultIp>,
    #[serde(default)]
    pub routes: Vec<ResultRoute>,
    #[serde(default)]
    pub dns: Value,
}

impl CniResult {
    /// The MAC of the result's interface `ifname` inside the sandbox (the
    /// VM's namespace), when it is a usable unicast one.
    pub fn mac_of(&self, ifname: &str) -> Option<[u8; 6]> {
        let i = self
            .interfaces
            .iter()
            .find(|i| i.name == ifname && !i.sandbox.is_empty())?;
        let mac = crate::core::convert::network::parse_mac(&i.mac)?;
        (mac[0] & 1 == 0 && mac != [0; 6]).then_some(mac)
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ResultIface {
    pub name: String,
    #[serde(default)]
    pub mac: String,
    #[serde(default)]
    pub mtu: Option<u32>,
    #[serde(default)]
    pub sandbox: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ResultIp {
    /// CIDR form: `10.1.0.5/24`.
    pub address: String,
    #[serde(default)]
    pub gateway: Option<String>,
    #[serde(default)]
    pub interface: Option<usize>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ResultRoute {
    pub dst: String,
    #[serde(default)]
    pub gw: Option<String>,
}

impl ResultIp {
    pub fn ip(&self) -> Option<core::net::IpAddr> {
        self.address.split_once('/')?.0.parse().ok()
    }

    pub fn prefix(&self) -> Option<u8> {
        self.address.split_once('/')?.1.parse().ok()
    }
}

/// Reads a plugin's stdout on success; an error result (`code`, `msg`)
/// becomes the plugin's error.
pub fn parse_result(plugin: &str, out: &[u8]) -> Result<(Value, CniResult), CniError> {
    let err = |m: String| CniError::Plugin {
        plugin: plugin.into(),
        message: m,
    };
    if out.len() > MAX_BYTES {
        return Err(err(format!("answered {} bytes", out.len())));
    }
    let v: Value =
        serde_json::from_slice(out).map_err(|e| err(format!("answered no JSON result: {e}")))?;
    if v.get("code").is_some() && v.get("msg").is_some() {
        return Err(err(error_message(&v)));
    }
    let r: CniResult = serde_json::from_value(v.clone())
        .map_err(|e| err(format!("answered a result kvirt cannot read: {e}")))?;
    for ip in &r.ips {
        if ip.ip().is_none() || ip.prefix().is_none() {
            return Err(err(format!("address {:?} is not CIDR", ip.address)));
        }
    }
    Ok((v, r))
}

/// A plugin's error output (`{"code", "msg", "details"}`), or its text.
pub fn plugin_failure(plugin: &str, status: &str, stdout: &[u8], stderr: &[u8]) -> CniError {
    let out = &stdout[..stdout.len().min(MAX_BYTES)];
    let message = match serde_json::from_slice::<Value>(out) {
        Ok(v) if v.get("msg").is_some() => error_message(&v),
        _ => {
            let text = String::from_utf8_lossy(if stderr.is_empty() { out } else { stderr });
            let text: String = text.trim().chars().take(512).collect();
            format!("{status}: {text}")
        }
    };
    CniError::Plugin {
        plugin: plugin.into(),
        message,
    }
}

fn error_message(v: &Value) -> String {
    let msg = v["msg"].as_str().unwrap_or("failed");
    match v["details"].as_str().filter(|d| !d.is_empty()) {
        Some(d) => format!("{msg} ({d}) [code {}]", v["code"]),
        None => format!("{msg} [code {}]", v["code"]),
    }
}

/// Multus's `k8s.v1.cni.cncf.io/network-status` entry for one network.
pub fn network_status(network: &NetworkRef, r: &CniResult, default: bool) -> Value {
    let mut o = Map::new();
    o.insert("name".into(), network.to_string().into());
    let sandbox = r.interfaces.iter().rev().find(|i| !i.sandbox.is_empty());
    if let Some(i) = sandbox {
        o.insert("interface".into(), i.name.clone().into());
    }
    let ips: Vec<Value> = r
        .ips
        .iter()
        .filter_map(|ip| ip.ip())
        .map(|ip| ip.to_string().into())
        .collect();
    if !ips.is_empty() {
        o.insert("ips".into(), ips.into());
    }
    if let Some(i) = sandbox {
        if !i.mac.is_empty() {
            o.insert("mac".into(), i.mac.clone().into());
        }
        if let Some(m) = i.mtu.filter(|m| *m > 0) {
            o.insert("mtu".into(), m.into());
        }
    }
    if default {
        o.insert("default".into(), true.into());
    }
    let dns = match &r.dns {
        Value::Object(d) => Value::Object(
            d.iter()
                .filter(|(k, v)| {
                    matches!(k.as_str(), "nameservers" | "domain" | "search" | "options")
                        && !v.is_null()
                })
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        ),
        _ => json!({}),
    };
    o.insert("dns".into(), dns);
    let gateways: Vec<Value> = r
        .routes
        .iter()
        .filter(|rt| rt.dst == "0.0.0.0/0" || rt.dst == "::/0")
        .filter_map(|rt| rt.gw.clone().map(Value::from))
        .collect();
    if !gateways.is_empty() {
        o.insert("gateway".into(), gateways.into());
    }
    Value::Object(o)
}

/// libcni's cache record of one attachment, under
/// `<cache dir>/results/<network>-<container id>-<ifname>`. kvirt writes it
/// before ADD (no result yet: an ADD that may have been cut short) and again
/// with the result after; DEL reads its config from here, never from the
/// NAD as it may have been edited since.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Record {
    pub kind: String,
    pub container_id: String,
    /// The list's JSON (Go's `[]byte`: base64 in the file).
    #[serde(with = "b64")]
    pub config: Vec<u8>,
    pub if_name: String,
    pub network_name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub netns: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cni_args: Vec<[String; 2]>,
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub capability_args: Map<String, Value>,
    #[serde(default, rename = "result", skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
}

mod b64 {
    use base64::Engine;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(b: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(b))
    }

    pub fn deserialize<'d, D: Deserializer<'d>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = String::deserialize(d)?;
        base64::engine::general_purpose::STANDARD
            .decode(s)
            .map_err(serde::de::Error::custom)
    }
}

impl Record {
    /// The record of an attachment about to be added (no result yet).
    pub fn before_add(list: &ConfList, rt: &Runtime) -> Self {
        Self {
            kind: CACHE_KIND.into(),
            container_id: rt.container_id.clone(),
            config: list.bytes.clone(),
            if_name: rt.ifname.clone(),
            network_name: list.name.clone(),
            netns: rt.netns.clone(),
            cni_args: rt.args.clone(),
            capability_args: rt.capability_args.clone(),
            result: None,
        }
    }

    /// Its file name under `results/` (libcni's).
    pub fn file_name(&self) -> String {
        file_name(&self.network_name, &self.container_id, &self.if_name)
    }

    pub fn runtime(&self) -> Runtime {
        Runtime {
            container_id: self.container_id.clone(),
            netns: self.netns.clone(),
            ifname: self.if_name.clone(),
            args: self.cni_args.clone(),
            capability_args: self.capability_args.clone(),
        }
    }

    /// Reads a record file, bounded; one that is not kvirt's (no
    /// [`VM_ARG`]) is `Ok(None)`: other runtimes share the directory.
    pub fn read(file: &str, bytes: &[u8]) -> Result<Option<Self>, CniError> {
        let err = |m: String| CniError::Record {
            file: file.into(),
            message: m,
        };
        if bytes.len() > 2 * MAX_BYTES {
            return Err(err(format!("{} bytes", bytes.len())));
        }
        let r: Record = serde_json::from_slice(bytes).map_err(|e| err(e.to_string()))?;
        if r.runtime().vm_id().is_none() {
            return Ok(None);
        }
        if r.kind != CACHE_KIND || r.file_name() != file {
            return Err(err("not the record its name says".into()));
        }
        Ok(Some(r))
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// The config for DEL, from the record.
    pub fn list(&self) -> Result<ConfList, CniError> {
        ConfList::from_bytes(&self.config)
    }
}

/// libcni's record file name; every part is checked to be a name (no `/`).
pub fn file_name(network: &str, container_id: &str, ifname: &str) -> String {
    format!("{network}-{container_id}-{ifname}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine;

    #[test]
    fn kubevirts_link_names() {
        // sha256("blue") = 16477688c0e00699c6cfa4497a3612d7e83c532062b64b250fed8908128ed548
        assert_eq!(pod_iface_name("blue"), "pod16477688c0e");
        let l = BridgeLinks::of("blue");
        assert_eq!(l.nic, "16477688c0e-nic");
        assert_eq!(l.bridge, "k6t-16477688c0e");
        assert_eq!(l.tap, "tap16477688c0e");
        for n in [&l.pod_iface, &l.nic, &l.bridge, &l.tap] {
            assert!(n.len() <= 15, "{n}");
        }
    }

    #[test]
    fn references_default_to_the_vmis_namespace() {
        let r = NetworkRef::parse("blue", "prod").unwrap();
        assert_eq!(r.to_string(), "prod/blue");
        assert_eq!(
            NetworkRef::parse("infra/blue", "prod").unwrap().namespace,
            "infra"
        );
        for bad in ["", "a/b/c", "Blue", "../x", "a/", "/a"] {
            assert!(NetworkRef::parse(bad, "prod").is_err(), "{bad}");
        }
    }

    #[test]
    fn a_single_plugin_is_wrapped_and_named_as_multus_does() {
        let l = resolve(
            "blue",
            r#"{"cniVersion":"0.3.1","type":"bridge","bridge":"br1","ipam":{"type":"host-local","subnet":"10.1.0.0/24"}}"#,
        )
        .unwrap();
        assert_eq!(l.name, "blue");
        assert_eq!(l.cni_version, "0.3.1");
        assert_eq!(l.types(), ["bridge"]);
        let v: Value = serde_json::from_slice(&l.bytes).unwrap();
        assert_eq!(v["plugins"][0]["bridge"], "br1");
        // A list keeps its own name.
        let l = resolve(
            "blue",
            r#"{"cniVersion":"1.0.0","name":"mynet","plugins":[{"type":"bridge"},{"type":"tuning"}]}"#,
        )
        .unwrap();
        assert_eq!(
            (l.name.as_str(), l.types()),
            ("mynet", vec!["bridge", "tuning"])
        );
        assert_eq!(ConfList::from_bytes(&l.bytes).unwrap(), l);
    }

    #[test]
    fn bad_configs_are_refused_with_the_reason() {
        for (config, why) in [
            ("not json", "not JSON"),
            ("[1]", "not a JSON object"),
            (r#"{"type":"bridge"}"#, "cniVersion is missing"),
            (
                r#"{"cniVersion":"9.9.9","type":"bridge"}"#,
                "not one kvirt speaks",
            ),
            (
                r#"{"cniVersion":"1.0.0","type":"../../bin/sh"}"#,
                "file name",
            ),
            (r#"{"cniVersion":"1.0.0","type":"/bin/sh"}"#, "file name"),
            (r#"{"cniVersion":"1.0.0","type":".hidden"}"#, "file name"),
            (r#"{"cniVersion":"1.0.0"}"#, "type"),
            (r#"{"cniVersion":"1.0.0","plugins":[]}"#, "plugins"),
            (r#"{"cniVersion":"1.0.0","plugins":["x"]}"#, "not an object"),
            (
                r#"{"cniVersion":"1.0.0","name":"a/b","type":"bridge"}"#,
                "network name",
            ),
        ] {
            let e = resolve("blue", config).unwrap_err().to_string();
            assert!(e.contains(why), "{config}: {e}");
            assert!(e.starts_with("network blue: "), "{e}");
        }
        let huge = format!(
            r#"{{"cniVersion":"1.0.0","type":"bridge","x":"{}"}}"#,
            "a".repeat(MAX_BYTES)
        );
        assert!(resolve("blue", &huge)
            .unwrap_err()
            .to_string()
            .contains("at most"));
    }

    fn runtime() -> Runtime {
        let mut rt = Runtime::for_vmi(
            "prod",
            "web",
            "uid-1",
            "prod_web",
            "/run/netns/kvirt-prod_web",
            "pod16477688c0e",
        );
        rt.capability_args
            .insert("mac".into(), "02:00:00:00:00:01".into());
        rt
    }

    #[test]
    fn plugins_get_the_spec_environment_and_libcnis_stdin() {
        let rt = runtime();
        let env = env(Command::Add, &rt, "/usr/lib/cni:/opt/cni/bin");
        let get = |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("CNI_COMMAND"), Some("ADD"));
        assert_eq!(get("CNI_CONTAINERID"), Some("uid-1"));
        assert_eq!(get("CNI_IFNAME"), Some("pod16477688c0e"));
        assert_eq!(
            get("CNI_ARGS"),
            Some("IgnoreUnknown=true;K8S_POD_NAMESPACE=prod;K8S_POD_NAME=web;K8S_POD_INFRA_CONTAINER_ID=uid-1;K8S_POD_UID=uid-1;KVIRT_VM=prod_web")
        );
        let l = resolve(
            "blue",
            r#"{"cniVersion":"1.0.0","plugins":[{"type":"bridge"},{"type":"tuning","capabilities":{"mac":true}}]}"#,
        )
        .unwrap();
        let first: Value = serde_json::from_slice(&plugin_stdin(&l, 0, None, &rt)).unwrap();
        assert_eq!(first["name"], "blue");
        assert_eq!(first["cniVersion"], "1.0.0");
        // Only a plugin that declares the capability gets it.
        assert!(first.get("runtimeConfig").is_none());
        let prev = json!({"cniVersion": "1.0.0", "ips": []});
        let second: Value = serde_json::from_slice(&plugin_stdin(&l, 1, Some(&prev), &rt)).unwrap();
        assert_eq!(second["runtimeConfig"]["mac"], "02:00:00:00:00:01");
        assert_eq!(second["prevResult"], prev);
        assert!(del_gets_prev_result("1.0.0") && del_gets_prev_result("0.4.0"));
        assert!(!del_gets_prev_result("0.3.1"));
    }

    #[test]
    fn results_of_each_version_read_alike() {
        let v031 = br#"{"cniVersion":"0.3.1","interfaces":[{"name":"br1","mac":"aa:bb:cc:dd:ee:01"},{"name":"veth1","mac":"aa:bb:cc:dd:ee:02"},{"name":"pod16477688c0e","mac":"02:00:00:00:00:01","sandbox":"/run/netns/x"}],"ips":[{"version":"4","interface":2,"address":"10.1.0.5/24","gateway":"10.1.0.1"}],"routes":[{"dst":"0.0.0.0/0","gw":"10.1.0.1"}],"dns":{}}"#;
        let v100 = br#"{"cniVersion":"1.0.0","interfaces":[{"name":"pod16477688c0e","mac":"02:00:00:00:00:01","sandbox":"/run/netns/x"}],"ips":[{"interface":0,"address":"fd00::5/64"}]}"#;
        let (_, a) = parse_result("bridge", v031).unwrap();
        assert_eq!(a.ips[0].ip(), Some("10.1.0.5".parse().unwrap()));
        assert_eq!(a.ips[0].prefix(), Some(24));
        let net = NetworkRef::parse("blue", "prod").unwrap();
        assert_eq!(
            network_status(&net, &a, false),
            json!({"name": "prod/blue", "interface": "pod16477688c0e", "ips": ["10.1.0.5"],
                   "mac": "02:00:00:00:00:01", "dns": {}, "gateway": ["10.1.0.1"]})
        );
        let (_, b) = parse_result("bridge", v100).unwrap();
        assert_eq!(network_status(&net, &b, false)["ips"], json!(["fd00::5"]));
        // Errors are the plugin's words.
        let e = parse_result("bridge", br#"{"cniVersion":"1.0.0","code":11,"msg":"no IP addresses available","details":"range full"}"#)
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "bridge: no IP addresses available (range full) [code 11]"
        );
        assert!(parse_result("x", b"[1,").is_err());
        assert!(parse_result("x", br#"{"ips":[{"address":"10.1.0.5"}]}"#)
            .unwrap_err()
            .to_string()
            .contains("CIDR"));
        let f = plugin_failure("vlan", "exit status 1", b"", b"failed to find master\n");
        assert_eq!(f.to_string(), "vlan: exit status 1: failed to find master");
    }

    #[test]
    fn records_are_libcnis_and_only_kvirts_are_taken() {
        let rt = runtime();
        let l = resolve("blue", r#"{"cniVersion":"1.0.0","type":"bridge"}"#).unwrap();
        let mut r = Record::before_add(&l, &rt);
        assert_eq!(r.file_name(), "blue-uid-1-pod16477688c0e");
        r.result = Some(json!({"cniVersion": "1.0.0"}));
        let bytes = r.to_bytes();
        let v: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["kind"], "cniCacheV1");
        assert_eq!(v["containerId"], "uid-1");
        assert_eq!(v["ifName"], "pod16477688c0e");
        assert_eq!(v["networkName"], "blue");
        // Go's []byte: base64.
        let config = base64::engine::general_purpose::STANDARD
            .decode(v["config"].as_str().unwrap())
            .unwrap();
        assert_eq!(config, l.bytes);
        let back = Record::read(&r.file_name(), &bytes).unwrap().unwrap();
        assert_eq!(back, r);
        assert_eq!(back.runtime().vm_id(), Some("prod_web"));
        assert_eq!(back.list().unwrap(), l);
        // Another runtime's record is left alone; one under a wrong name is refused.
        let mut other = r.clone();
        other.cni_args.retain(|[k, _]| k != VM_ARG);
        assert_eq!(
            Record::read(&other.file_name(), &other.to_bytes()).unwrap(),
            None
        );
        assert!(Record::read("blue-uid-2-eth0", &bytes).is_err());
        assert!(Record::read("x", b"{").is_err());
    }
}
