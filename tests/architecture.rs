//! The layers of `src/` are checked, not hoped for. Every `.rs` file is
//! read (comments and string literals stripped) and its paths are checked
//! against what its layer may use:
//!
//! - `core` is pure: of the crates kvirt depends on it may name only
//!   [`CORE_CRATES`] (data and codecs, no I/O), none of std's I/O modules
//!   ([`CORE_STD_FORBIDDEN`]), and nothing of `host`, `sources` or `daemon`;
//! - `host` and `sources` may use `core` only: not each other, not `daemon`;
//! - `daemon` may use `core`, `host` and `sources`; `bin` may use all.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

/// The dependencies `core` may name: types, serialisation and codecs.
/// Addresses come from `core::net`, which has no sockets.
const CORE_CRATES: &[&str] = &[
    "serde",
    "serde_json",
    "serde_norway",
    "quick_xml",
    "k8s_openapi",
    "thiserror",
    "sha2",
    "base64",
    // UUIDs as values (name-derived v5 only: no random source is enabled).
    "uuid",
    // The nftables JSON schema as types; applying it is host's.
    "nftables",
    // The DHCP message codec; the sockets are host's.
    "dhcproto",
];

/// Single items of otherwise forbidden crates that are plain data.
fn core_allows_item(krate: &str, item: &str) -> bool {
    match krate {
        // The image reference grammar the registry client itself uses.
        "oci_client" => item == "Reference",
        // errno constants (`SystemCallErrorNumber=`), no calls.
        "libc" => !item.is_empty() && item.chars().all(|c| c.is_ascii_uppercase() || c == '_'),
        _ => false,
    }
}

/// std's modules that do I/O or touch the process.
const CORE_STD_FORBIDDEN: &[&str] = &["fs", "process", "net", "os", "env", "thread", "io::stdin"];

const LAYERS: &[&str] = &["core", "host", "sources", "daemon", "bin"];

#[derive(Debug, PartialEq, Eq)]
struct Violation {
    file: PathBuf,
    line: usize,
    what: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}: {}", self.file.display(), self.line, self.what)
    }
}

/// The source with comments and the contents of string and character
/// literals blanked out (newlines kept, so line numbers stay right): what
/// a comment says or a test string contains is not an import.
fn code_only(src: &str) -> String {
    let b: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    let blank = |c: char| if c == '\n' { '\n' } else { ' ' };
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(blank(b[i]));
                    i += 1;
                }
            }
        } else if c == 'r'
            && (next == Some('"') || next == Some('#'))
            && (i == 0 || !is_ident(b[i - 1]))
        {
            // r"..." or r#"..."#: ends at a quote followed by as many #.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            out.push('"');
            i = j + 1;
            while i < b.len() {
                if b[i] == '"' && (1..=hashes).all(|k| b.get(i + k) == Some(&'#')) {
                    out.push('"');
                    i += 1 + hashes;
                    break;
                }
                out.push(blank(b[i]));
                i += 1;
            }
        } else if c == '"' {
            out.push('"');
            i += 1;
            while i < b.len() && b[i] != '"' {
                if b[i] == '\\' {
                    out.push(' ');
                    i += 1;
                }
                if i < b.len() {
                    out.push(blank(b[i]));
                    i += 1;
                }
            }
            out.push('"');
            i += 1;
        } else if c == '\'' {
            // A char literal ('x', '\n', '\u{..}'), else a lifetime.
            let end = if next == Some('\\') {
                (i + 3..b.len()).find(|&j| b[j] == '\'')
            } else if b.get(i + 2) == Some(&'\'') {
                Some(i + 2)
            } else {
                None
            };
            match end {
                Some(e) => {
                    out.push_str(&" ".repeat(e - i + 1));
                    i = e + 1;
                }
                None => {
                    out.push(c);
                    i += 1;
                }
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Every path in the code, as its segments (`std::{fs, io::Write}` gives
/// `std::fs` and `std::io::Write`), with the line it starts on.
fn paths(code: &str) -> Vec<(usize, Vec<String>)> {
    let mut out = Vec::new();
    // Tokens: identifiers, `::`, braces and commas; everything else splits.
    let mut toks: Vec<(usize, String)> = Vec::new();
    let mut line = 1;
    let chars: Vec<char> = code.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if is_ident(c) {
            let start = i;
            while i < chars.len() && is_ident(chars[i]) {
                i += 1;
            }
            toks.push((line, chars[start..i].iter().collect()));
        } else if c == ':' && chars.get(i + 1) == Some(&':') {
            toks.push((line, "::".into()));
            i += 2;
        } else if matches!(c, '{' | '}' | ',') {
            toks.push((line, c.to_string()));
            i += 1;
        } else {
            if !c.is_whitespace() {
                toks.push((line, ";".into()));
            }
            i += 1;
        }
    }
    // Walks a path from token `at` with `prefix` before it; groups recurse.
    fn walk(
        toks: &[(usize, String)],
        mut at: usize,
        mut prefix: Vec<String>,
        line: usize,
        out: &mut Vec<(usize, Vec<String>)>,
    ) -> usize {
        loop {
            match toks.get(at).map(|t| t.1.as_str()) {
                Some(t) if is_ident(t.chars().next().unwrap_or(' ')) => {
                    prefix.push(t.to_owned());
                    at += 1;
                    if toks.get(at).map(|t| t.1.as_str()) == Some("::") {
                        at += 1;
                        continue;
                    }
                    out.push((line, prefix));
                    return at;
                }
                Some("{") => {
                    at += 1;
                    loop {
                        if toks.get(at).map(|t| t.1.as_str()) == Some("}") {
                            return at + 1;
                        }
                        at = walk(toks, at, prefix.clone(), line, out);
                        match toks.get(at).map(|t| t.1.as_str()) {
                            Some(",") => at += 1,
                            Some("}") => return at + 1,
                            _ => return at,
                        }
                    }
                }
                _ => {
                    if !prefix.is_empty() {
                        out.push((line, prefix));
                    }
                    return at;
                }
            }
        }
    }
    let mut at = 0;
    while at < toks.len() {
        let starts = toks[at].1.chars().next().is_some_and(is_ident)
            && toks.get(at + 1).map(|t| t.1.as_str()) == Some("::")
            && (at == 0 || toks[at - 1].1 != "::");
        if starts {
            let line = toks[at].0;
            at = walk(&toks, at, Vec::new(), line, &mut out).max(at + 1);
        } else {
            at += 1;
        }
    }
    out
}

/// The crates kvirt depends on, as Rust names.
fn dependencies(manifest: &str) -> Vec<String> {
    let mut in_deps = false;
    let mut deps = Vec::new();
    for line in manifest.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            in_deps = line == "[dependencies]";
            continue;
        }
        if let (true, Some((name, _))) = (in_deps, line.split_once('=')) {
            deps.push(name.trim().replace('-', "_"));
        }
    }
    deps
}

/// What a file in `layer` may not use, found in its code.
fn check(file: &Path, layer: &str, src: &str, deps: &[String]) -> Vec<Violation> {
    let mut found = Vec::new();
    let mut flag = |line: usize, what: String| {
        found.push(Violation {
            file: file.to_owned(),
            line,
            what,
        })
    };
    for (line, p) in paths(&code_only(src)) {
        let shown = p.join("::");
        let first = p[0].as_str();
        // `crate::x` or `super::…::x`: the layer reached.
        let reached = match first {
            "crate" => p.get(1).map(String::as_str),
            "super" => p.iter().find(|s| *s != "super").map(String::as_str),
            _ => None,
        };
        let may_reach: &[&str] = match layer {
            "core" => &["core"],
            "host" | "sources" => &["core", layer],
            "daemon" => &["core", "host", "sources", "daemon"],
            _ => LAYERS,
        };
        if let Some(l) = reached.filter(|l| LAYERS.contains(l) && !may_reach.contains(l)) {
            flag(line, format!("{layer} must not use {l}: {shown}"));
        }
        if layer != "core" {
            continue;
        }
        if first == "std" {
            let rest = p[1..].join("::");
            if let Some(m) = CORE_STD_FORBIDDEN
                .iter()
                .find(|m| rest == **m || rest.starts_with(&format!("{m}::")))
            {
                flag(
                    line,
                    format!("core does no I/O, but uses std::{m}: {shown}"),
                );
            }
        } else if deps.iter().any(|d| d == first)
            && !CORE_CRATES.contains(&first)
            && !core_allows_item(first, p.get(1).map_or("", String::as_str))
        {
            flag(
                line,
                format!("core does no I/O, but uses the crate {first}: {shown}"),
            );
        }
    }
    found
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

fn deps() -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    dependencies(&std::fs::read_to_string(root.join("Cargo.toml")).unwrap())
}

#[test]
fn imports_point_down_only() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let deps = deps();
    assert!(
        deps.iter().any(|d| d == "tokio"),
        "dependencies read: {deps:?}"
    );
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    let mut checked: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    let mut violations = Vec::new();
    for file in &files {
        let rel = file.strip_prefix(root.join("src")).unwrap();
        let layer = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_str()
            .unwrap();
        let Some(layer) = LAYERS.iter().find(|l| **l == layer) else {
            assert_eq!(rel, Path::new("lib.rs"), "a file outside the layers");
            continue;
        };
        let src = std::fs::read_to_string(file).unwrap();
        violations.extend(check(rel, layer, &src, &deps));
        checked
            .entry(layer)
            .or_default()
            .push(rel.display().to_string());
    }
    for (layer, files) in &checked {
        println!("{layer}: {} files: {}", files.len(), files.join(" "));
    }
    // Cannot pass by reading nothing: every layer has its known files.
    for known in [
        "core/vmi.rs",
        "core/convert/domain.rs",
        "core/nft.rs",
        "host/libvirt.rs",
        "host/network.rs",
        "sources/manifest.rs",
        "sources/cluster/source.rs",
        "daemon/controller.rs",
        "bin/kvirtd.rs",
    ] {
        assert!(
            checked.values().flatten().any(|f| f == known),
            "{known} was not checked"
        );
    }
    let shown: Vec<String> = violations.iter().map(|v| v.to_string()).collect();
    assert!(
        shown.is_empty(),
        "imports against the layers:\n{}",
        shown.join("\n")
    );
}

/// The checker itself: what it must find, and what it must not.
#[test]
fn the_checker_finds_what_it_should() {
    let deps = deps();
    let f = Path::new("core/x.rs");
    let found = |layer: &str, src: &str| -> Vec<String> {
        check(f, layer, src, &deps)
            .into_iter()
            .map(|v| v.what)
            .collect()
    };
    for bad in [
        "use tokio::sync::mpsc;",
        "use zbus::Connection;",
        "fn f() { virt::connect::Connect::open(None); }",
        "use rtnetlink::Handle;",
        "use nix::sched::setns;",
        "use kube::Client;",
        "use std::fs;",
        "use std::{collections::BTreeMap, fs::File};",
        "fn f() { std::process::Command::new(\"ip\"); }",
        "use std::net::UdpSocket;",
        "use std::os::unix::net::UnixStream;",
        "use crate::host::libvirt::DomainRef;",
        "use crate::{core::vmi, daemon::controller::Controller};",
        "use super::super::sources::StatusStore;",
        "use oci_client::Client;",
        "fn f() { unsafe { libc::kill(1, 9) }; }",
    ] {
        assert_eq!(found("core", bad).len(), 1, "not caught in core: {bad}");
    }
    for fine in [
        "use std::collections::BTreeMap;\nuse core::net::Ipv4Addr;",
        "use serde::Deserialize; use quick_xml::se::to_string;",
        "use crate::core::vmi::VirtualMachineInstance;",
        "use oci_client::Reference;",
        "const E: i32 = libc::EPERM;",
        "// use tokio::sync::mpsc;\n/* std::fs::read */",
        "let s = \"std::process::Command\"; let r = r#\"use nix::x\"#;",
        "fn f<'a>(x: &'a str) -> char { 'x' }",
        "fn kvirt() { let kubevirt = 1; }",
    ] {
        assert_eq!(
            found("core", fine),
            Vec::<String>::new(),
            "flagged in core: {fine}"
        );
    }
    assert_eq!(found("host", "use crate::daemon::fake::FakeHost;").len(), 1);
    assert_eq!(found("host", "use crate::sources::StatusStore;").len(), 1);
    assert_eq!(found("sources", "use crate::host::journal;").len(), 1);
    assert_eq!(
        found("sources", "use crate::daemon::controller::Controller;").len(),
        1
    );
    assert!(found("host", "use tokio::sync::mpsc; use crate::core::key;").is_empty());
    assert!(found("daemon", "use crate::{host::netns, sources::StatusStore};").is_empty());
}
