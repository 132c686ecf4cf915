//! The README and the manual (`docs/`) say only what the tree holds, so they
//! cannot drift from it unnoticed:
//!
//! - every test they name exists as a test function, every module path
//!   they name as a module, every metric as one kvirtd exports; any other
//!   `snake_case` name in backticks must be one of a short list of outside
//!   names, so a misspelt or removed test cannot pass as prose;
//! - the configuration reference lists every key of kvirtd's `Config`, and
//!   nothing else, each with its true default; the shipped `kvirtd.toml`
//!   mentions every key too;
//! - every `kvirtctl` subcommand and `kvirtd` option has its entry in the
//!   command reference, and every entry there is a real command;
//! - the man pages' list of manual pages is `docs/`, the README's table of
//!   contents links every page, and every relative link resolves (file and
//!   heading).

use kvirt::daemon::config::Config;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn top() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// README.md and every page of docs/, with their text.
fn pages() -> Vec<(PathBuf, String)> {
    let mut files = vec![top().join("README.md")];
    files.extend(manual_files());
    files
        .into_iter()
        .map(|f| {
            let text =
                std::fs::read_to_string(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
            (f, text)
        })
        .collect()
}

fn manual_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(top().join("docs"))
        .expect("docs/ exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    files.sort();
    files
}

/// The text outside fenced code blocks: what a reader takes as prose.
fn prose(text: &str) -> String {
    let mut out = String::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// Inline code spans of the prose (a span may wrap across lines).
fn code_spans(text: &str) -> Vec<String> {
    let p = prose(text);
    let mut spans = Vec::new();
    let mut rest = p.as_str();
    while let Some(start) = rest.find('`') {
        let after = &rest[start..];
        let ticks = after.len() - after.trim_start_matches('`').len();
        let body = &after[ticks..];
        let close = "`".repeat(ticks);
        let Some(end) = body.find(&close) else { break };
        spans.push(body[..end].split_whitespace().collect::<Vec<_>>().join(" "));
        rest = &body[end + ticks..];
    }
    spans
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Every function marked `#[test]` or `#[tokio::test]` under src/ and tests/.
fn test_functions() -> BTreeSet<String> {
    let mut files = Vec::new();
    rust_files(&top().join("src"), &mut files);
    rust_files(&top().join("tests"), &mut files);
    let mut names = BTreeSet::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let mut pending = false;
        for line in text.lines() {
            let t = line.trim_start();
            if t.starts_with("#[test]") || t.starts_with("#[tokio::test") {
                pending = true;
            } else if pending {
                let t = t.trim_start_matches("pub ").trim_start_matches("async ");
                if let Some(rest) = t.strip_prefix("fn ") {
                    let name: String = rest
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    names.insert(name);
                    pending = false;
                } else if !(t.starts_with("#[") || t.starts_with("//") || t.is_empty()) {
                    pending = false;
                }
            }
        }
    }
    assert!(
        names.len() > 300,
        "the scan found only {} tests",
        names.len()
    );
    names
}

/// `a::b::c` is a module of the crate: src/a/b/c.rs or src/a/b/c/mod.rs.
fn is_module(path: &str) -> bool {
    let rel: PathBuf = path.split("::").collect();
    let src = top().join("src");
    src.join(&rel).with_extension("rs").is_file() || src.join(&rel).join("mod.rs").is_file()
}

/// kvirtd's configuration keys (`section.key`, or `key` at the top) with
/// their defaults, from the `Config` struct itself.
fn config_keys() -> BTreeMap<String, toml::Value> {
    fn walk(prefix: &str, t: &toml::Table, out: &mut BTreeMap<String, toml::Value>) {
        for (k, v) in t {
            let key = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            match v {
                // A struct is a section; an empty table is a map's default.
                toml::Value::Table(sub) if !sub.is_empty() => walk(&key, sub, out),
                v => {
                    out.insert(key, v.clone());
                }
            }
        }
    }
    let value = toml::Value::try_from(Config::default()).expect("the config serializes");
    let mut out = BTreeMap::new();
    walk("", value.as_table().unwrap(), &mut out);
    out
}

/// The names given to `register(` calls: the metrics kvirtd exports.
fn registered_metrics(src: &str) -> BTreeSet<String> {
    src.split("register(")
        .skip(1)
        .filter_map(|rest| rest.trim_start().strip_prefix('"'))
        .filter_map(|rest| rest.split('"').next())
        .map(str::to_owned)
        .collect()
}

/// Outside names the docs may put in backticks: libvirt's, the kernel's,
/// nftables' — not kvirt's, so nothing here can be checked against the tree.
const OUTSIDE_NAMES: &[&str] = &[
    "max_size",               // virtlogd.conf
    "stdio_handler",          // qemu.conf
    "auto_shutdown_try_save", // qemu.conf
    "tun_chr_close",          // the kernel's tap close
];

#[test]
fn every_name_the_docs_give_in_backticks_is_in_the_tree() {
    let tests = test_functions();
    let keys = config_keys();
    let leaves: BTreeSet<&str> = keys.keys().map(|k| k.rsplit('.').next().unwrap()).collect();
    let sections: BTreeSet<&str> = keys
        .keys()
        .filter_map(|k| k.split_once('.'))
        .map(|(s, _)| s)
        .collect();
    let metrics =
        registered_metrics(&std::fs::read_to_string(top().join("src/daemon/metrics.rs")).unwrap());
    let nft = std::fs::read_to_string(top().join("src/core/nft.rs")).unwrap();
    let mut wrong = Vec::new();
    let mut named_tests = 0;
    for (file, text) in pages() {
        let file = file.strip_prefix(top()).unwrap().display().to_string();
        for span in code_spans(&text) {
            let ident = |s: &str| {
                !s.is_empty()
                    && s.starts_with(|c: char| c.is_ascii_lowercase())
                    && s.chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
            };
            if span.contains("::") && span.split("::").all(ident) {
                let last = span.rsplit("::").next().unwrap();
                if tests.contains(last) {
                    named_tests += 1;
                } else if !is_module(&span) {
                    wrong.push(format!("{file}: `{span}` is neither a module nor a test"));
                }
                continue;
            }
            // `storage.image_max_*`: a configuration key, or keys.
            if let Some((section, _)) = span.split_once('.') {
                if sections.contains(section)
                    && span
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "._*".contains(c))
                {
                    let prefix = span.trim_end_matches('*');
                    let known = if span.ends_with('*') {
                        keys.keys().any(|k| k.starts_with(prefix))
                    } else {
                        keys.contains_key(&span)
                            || keys.keys().any(|k| k.starts_with(&format!("{span}.")))
                    };
                    if !known {
                        wrong.push(format!("{file}: `{span}` is not a configuration key"));
                    }
                    continue;
                }
            }
            // A metric, with or without its labels.
            let bare = span.split('{').next().unwrap();
            if bare.starts_with("kvirt_") && ident(bare) {
                // prometheus-client adds `kvirt_` and, to counters, `_total`.
                let name = bare.trim_start_matches("kvirt_");
                let known = metrics.contains(name)
                    || name
                        .strip_suffix("_total")
                        .is_some_and(|n| metrics.contains(n));
                if !known {
                    wrong.push(format!("{file}: `{span}` is not a metric kvirtd exports"));
                }
                continue;
            }
            if !ident(&span) || !span.contains('_') {
                continue;
            }
            if tests.contains(&span) {
                named_tests += 1;
            } else if !(leaves.contains(span.as_str())
                || OUTSIDE_NAMES.contains(&span.as_str())
                || nft.contains(&format!("\"{span}\"")))
            {
                wrong.push(format!(
                    "{file}: `{span}` is no test function, configuration key or known name"
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    assert!(named_tests >= 40, "the docs name only {named_tests} tests");
}

/// The rows of the configuration reference: `key` → its default's text.
fn reference_rows() -> BTreeMap<String, String> {
    let text = std::fs::read_to_string(top().join("docs/configuration.md")).unwrap();
    let mut rows = BTreeMap::new();
    for line in prose(&text).lines() {
        let cells: Vec<&str> = line
            .split(" | ")
            .map(|c| c.trim_matches(|c| c == '|' || c == ' '))
            .collect();
        if cells.len() < 3 {
            continue;
        }
        let (Some(key), Some(default)) = (
            cells[0].strip_prefix('`').and_then(|c| c.strip_suffix('`')),
            cells[1].strip_prefix('`').and_then(|c| c.strip_suffix('`')),
        ) else {
            continue;
        };
        assert!(
            rows.insert(key.to_owned(), default.to_owned()).is_none(),
            "`{key}` is documented twice"
        );
    }
    rows
}

#[test]
fn the_configuration_reference_is_every_key_with_its_default() {
    let keys = config_keys();
    let rows = reference_rows();
    let documented: BTreeSet<&String> = rows.keys().collect();
    let real: BTreeSet<&String> = keys.keys().collect();
    assert_eq!(
        documented, real,
        "docs/configuration.md against kvirtd's Config (left: documented, right: real)"
    );
    for (key, default) in &rows {
        let parsed: toml::Table = toml::from_str(&format!("v = {default}"))
            .unwrap_or_else(|e| panic!("`{key}`: the default `{default}` is not TOML: {e}"));
        assert_eq!(
            &parsed["v"], &keys[key],
            "`{key}`: documented default `{default}`"
        );
    }
    // The shipped file, every key commented out with its default, names them all.
    let shipped = std::fs::read_to_string(top().join("systemd/kvirtd.toml")).unwrap();
    for key in keys.keys() {
        let leaf = key.rsplit('.').next().unwrap();
        assert!(
            shipped.contains(&format!("#{leaf} =")) || shipped.contains(&format!("#[{key}]")),
            "systemd/kvirtd.toml does not mention `{key}`"
        );
    }
}

/// The names of a command's subcommands or long options, from its --help.
fn help_of(bin: &str, args: &[&str]) -> String {
    let out = std::process::Command::new(bin).args(args).output().unwrap();
    assert!(out.status.success(), "{bin} {args:?}");
    String::from_utf8(out.stdout).unwrap()
}

fn subcommands(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_owned)
        .collect()
}

/// The long options a --help lists (one per option line).
fn long_options(help: &str) -> Vec<String> {
    help.lines()
        .map(str::trim_start)
        .filter(|l| l.starts_with('-'))
        .filter_map(|l| l.split_whitespace().find(|w| w.starts_with("--")))
        .map(|w| w.trim_end_matches(',').to_owned())
        .filter(|w| w != "--help" && w != "--version")
        .collect()
}

/// A `### heading` of the page and its text up to the next heading.
fn section<'a>(page: &'a str, heading: &str) -> Option<&'a str> {
    let start = page.find(&format!("\n### {heading}\n"))? + 1;
    let body = &page[start..];
    let end = body[4..].find("\n#").map_or(body.len(), |i| i + 5);
    Some(&body[..end])
}

#[test]
fn every_command_and_option_is_documented() {
    let reference = std::fs::read_to_string(top().join("docs/commands.md")).unwrap();
    let headings: BTreeSet<String> = reference
        .lines()
        .filter_map(|l| l.strip_prefix("### "))
        .map(str::to_owned)
        .collect();
    let ctl = env!("CARGO_BIN_EXE_kvirtctl");
    let top_help = help_of(ctl, &["--help"]);
    let global = long_options(&top_help);
    for opt in &global {
        assert!(
            reference.contains(opt.as_str()),
            "docs/commands.md does not mention kvirtctl's {opt}"
        );
    }
    let commands = subcommands(&top_help);
    assert!(commands.len() >= 10, "{commands:?}");
    let mut expected = BTreeSet::new();
    for c in &commands {
        let entry = format!("kvirtctl {c}");
        let Some(text) = section(&reference, &entry) else {
            panic!("docs/commands.md has no `### {entry}`");
        };
        for opt in long_options(&help_of(ctl, &[c, "--help"])) {
            assert!(
                global.contains(&opt) || text.contains(&opt),
                "docs/commands.md does not document `{entry} {opt}` under its heading"
            );
        }
        expected.insert(entry);
    }
    let daemon = env!("CARGO_BIN_EXE_kvirtd");
    let daemon_help = help_of(daemon, &["--help"]);
    for c in subcommands(&daemon_help) {
        let entry = format!("kvirtd {c}");
        let Some(text) = section(&reference, &entry) else {
            panic!("docs/commands.md has no `### {entry}`");
        };
        for opt in long_options(&help_of(daemon, &[&c, "--help"])) {
            assert!(
                opt == "--config" || text.contains(&opt),
                "docs/commands.md does not document `{entry} {opt}` under its heading"
            );
        }
        expected.insert(entry);
    }
    for opt in long_options(&daemon_help) {
        let entry = format!("kvirtd {opt}");
        assert!(
            headings.contains(&entry),
            "docs/commands.md has no `### {entry}`"
        );
        expected.insert(entry);
    }
    let extra: Vec<&String> = headings
        .iter()
        .filter(|h| h.starts_with("kvirt") && !expected.contains(*h))
        .collect();
    assert!(
        extra.is_empty(),
        "docs/commands.md documents what does not exist: {extra:?}"
    );
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces
/// to hyphens.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == '-' || *c == '_' || *c == ' ')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

#[test]
fn the_manual_is_linked_whole_and_every_link_resolves() {
    let on_disk: BTreeSet<String> = manual_files()
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    let listed: BTreeSet<String> = kvirt::daemon::man::MANUAL
        .iter()
        .map(|(p, _)| p.to_string())
        .collect();
    assert_eq!(listed, on_disk, "daemon::man::MANUAL against docs/");

    let readme = std::fs::read_to_string(top().join("README.md")).unwrap();
    assert!(
        readme.lines().count() <= 300,
        "README.md has {} lines",
        readme.lines().count()
    );
    for page in &on_disk {
        assert!(
            readme.contains(&format!("(docs/{page})")),
            "README.md does not link docs/{page}"
        );
    }

    let mut broken = Vec::new();
    for (file, text) in pages() {
        let text = prose(&text);
        for part in text.split("](").skip(1) {
            let Some(target) = part.split(')').next() else {
                continue;
            };
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (path, frag) = target.split_once('#').unwrap_or((target, ""));
            let dest = if path.is_empty() {
                file.clone()
            } else {
                file.parent().unwrap().join(path)
            };
            if !dest.exists() {
                broken.push(format!("{}: ({target}) names no file", file.display()));
                continue;
            }
            if !frag.is_empty() {
                let body = std::fs::read_to_string(&dest).unwrap_or_default();
                let found = prose(&body)
                    .lines()
                    .filter_map(|l| {
                        l.trim_start_matches('#')
                            .strip_prefix(' ')
                            .filter(|_| l.starts_with('#'))
                    })
                    .any(|h| anchor(h) == frag);
                if !found {
                    broken.push(format!("{}: ({target}) names no heading", file.display()));
                }
            }
        }
    }
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

#[test]
fn the_checks_catch_what_they_should() {
    assert_eq!(
        code_spans("a `x_y` b ``c`d`` e\n```\n`in_fence`\n```\n`wrapped\nspan`"),
        ["x_y", "c`d", "wrapped span"]
    );
    assert_eq!(
        anchor("What kvirt is, and is not"),
        "what-kvirt-is-and-is-not"
    );
    assert_eq!(anchor("`kvirtctl ls`"), "kvirtctl-ls");
    assert!(is_module("core::vm") && is_module("sources::cluster") && !is_module("core::nothing"));
    assert_eq!(
        subcommands("Usage: x\n\nCommands:\n  ls  List\n  help  H\n\nOptions:\n"),
        ["ls"]
    );
    assert_eq!(
        long_options("Options:\n  -c, --config <C>\n          Uses --other\n      --grace <G>\n  -h, --help\n"),
        ["--config", "--grace"]
    );
    let page = "# T\n### a\nx --y\n### b\nz\n";
    assert_eq!(section(page, "a"), Some("### a\nx --y\n"));
    assert_eq!(section(page, "b"), Some("### b\nz\n"));
    let keys = config_keys();
    assert_eq!(keys["source.kind"], toml::Value::String("directory".into()));
    assert!(keys.contains_key("storage.host_disk_roots_by_namespace"));
    assert!(keys.contains_key("node_name"));
    assert_eq!(
        registered_metrics("r.register(\"a\", x);\nr.register(\n    \"b_c\",\n)"),
        BTreeSet::from(["a".to_owned(), "b_c".to_owned()])
    );
}

/// The README's first VM is one kvirt runs: it parses and converts, with
/// nothing refused.
#[test]
fn the_readmes_first_vm_converts() {
    use kvirt::core::convert::{convert, ConvertContext, DomainType};
    let readme = std::fs::read_to_string(top().join("README.md")).unwrap();
    let yaml = readme
        .split("```yaml\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("README.md shows a VMI manifest");
    let mut vmi = kvirt::core::vmi::VirtualMachineInstance::from_yaml(yaml).unwrap();
    vmi.metadata.uid = Some("u".into());
    let key = vmi.key().unwrap();
    let layout = kvirt::core::layout::HostLayout::default();
    let paths = layout.vm(&key);
    let ctx = ConvertContext {
        key: &key,
        paths: &paths,
        domain_type: DomainType::Kvm,
        host_disk_roots: &[],
        shared_roots: &[],
        cluster: false,
        capacity: None,
        limits: kvirt::core::convert::Limits::default(),
        claims: &kvirt::core::convert::NO_CLAIMS,
        dedicated_cpus: None,
    };
    let c = convert(&vmi, &ctx).unwrap_or_else(|e| panic!("{e}\n{yaml}"));
    assert!(c.network.is_some(), "the pod network by default");
}
