//! What this host can give a VM at most: its memory and CPUs.

use crate::core::convert::HostCapacity;

/// `MemTotal` from `/proc/meminfo` and the CPUs kvirtd may run on.
pub fn read() -> std::io::Result<HostCapacity> {
    let meminfo = std::fs::read_to_string("/proc/meminfo")?;
    let memory_bytes = mem_total(&meminfo).ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "no MemTotal in /proc/meminfo",
        )
    })?;
    let cpus = std::thread::available_parallelism()?.get() as u32;
    Ok(HostCapacity { memory_bytes, cpus })
}

fn mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    #[test]
    fn mem_total_is_read_in_bytes() {
        let m = "MemTotal:        8039036 kB\nMemFree:          123 kB\n";
        assert_eq!(super::mem_total(m), Some(8039036 * 1024));
        assert_eq!(super::mem_total("MemFree: 1 kB\n"), None);
        assert!(super::read().unwrap().cpus >= 1);
    }
}
