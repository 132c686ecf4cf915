//! The man pages, kvirtd(8) and kvirtctl(1): clap's rendering of `--help`,
//! then FILES and SEE ALSO pointing at the manual the packages install, so
//! an operator who types `man kvirtd` finds the rest.

use std::io::{self, Write};

/// Where the packages install README.md and the manual (`docs/`).
pub const DOC_DIR: &str = "/usr/share/doc/kvirt";

/// The manual's pages (in `docs/`, installed under [`DOC_DIR`]`/docs`) and
/// what each holds; `tests/docs.rs` checks this list against the tree.
pub const MANUAL: &[(&str, &str)] = &[
    ("architecture.md", "the layers, the loop, the per-VM unit"),
    ("standalone.md", "the manifest directory and status files"),
    ("cluster.md", "CRDs, RBAC, namespace opt-in, claiming"),
    (
        "virtual-machines.md",
        "VirtualMachines and their runStrategy",
    ),
    (
        "vmi-fields.md",
        "every VMI field: used, accepted or refused",
    ),
    ("storage.md", "containerDisks, hostDisks and other volumes"),
    ("networking.md", "the pod-like network and DHCP"),
    (
        "isolation.md",
        "the threat model and what each VM is kept from",
    ),
    (
        "migration.md",
        "live migration: what could move, the tunnel",
    ),
    ("reliability.md", "what survives what"),
    ("observing.md", "status, logs, machined and metrics"),
    ("configuration.md", "every key of kvirtd.toml"),
    ("commands.md", "kvirtctl and kvirtd, command by command"),
    ("performance.md", "the benchmark and its current figures"),
    ("testing.md", "the test tiers and the test host"),
    ("packaging.md", "the .deb and .rpm, upgrades and removal"),
];

/// Files a page names under FILES: (path, what it is).
pub type Files<'a> = &'a [(&'a str, &'a str)];

/// Renders `cmd`'s man page in `section`, with `files` and the manual.
pub fn render(
    cmd: clap::Command,
    section: &str,
    files: Files,
    out: &mut dyn Write,
) -> io::Result<()> {
    let name = cmd.get_name().to_owned();
    clap_mangen::Man::new(cmd).section(section).render(out)?;
    if !files.is_empty() {
        writeln!(out, ".SH FILES")?;
        for (path, what) in files {
            writeln!(out, ".TP\n\\fB{}\\fR\n{}", roff(path), roff(what))?;
        }
    }
    writeln!(out, ".SH \"SEE ALSO\"")?;
    writeln!(
        out,
        "The manual is installed in \\fB{}\\fR: README.md first, then one page per area in docs/:",
        roff(DOC_DIR)
    )?;
    for (page, what) in MANUAL {
        writeln!(out, ".TP\n\\fBdocs/{}\\fR\n{}", roff(page), roff(what))?;
    }
    let others: Vec<&str> = ["kvirtd(8)", "kvirtctl(1)"]
        .into_iter()
        .filter(|p| !p.starts_with(&format!("{name}(")))
        .chain(["systemctl(1)", "journalctl(1)", "machinectl(1)", "virsh(1)"])
        .collect();
    writeln!(out, ".PP\n{}", roff(&others.join(", ")))
}

/// Text as roff shows it literally: backslashes and hyphens escaped, and
/// no line starting with a control character.
fn roff(text: &str) -> String {
    let t = text.replace('\\', "\\e").replace('-', "\\-");
    if t.starts_with(['.', '\'']) {
        format!("\\&{t}")
    } else {
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_man_page_names_its_files_and_the_installed_manual() {
        let cmd = clap::Command::new("kvirtd").about("x");
        let mut out = Vec::new();
        render(
            cmd,
            "8",
            &[("/etc/kvirt/kvirtd.toml", "the configuration")],
            &mut out,
        )
        .unwrap();
        let page = String::from_utf8(out).unwrap();
        assert!(page.contains(".TH kvirtd 8"), "{page}");
        assert!(page.contains("\\fB/etc/kvirt/kvirtd.toml\\fR"), "{page}");
        assert!(page.contains("/usr/share/doc/kvirt"), "{page}");
        assert!(page.contains("docs/configuration.md"), "{page}");
        assert!(
            page.contains("kvirtctl(1)") && !page.contains("kvirtd(8)"),
            "{page}"
        );
        assert_eq!(roff(".x-y\\"), "\\&.x\\-y\\e");
    }
}
