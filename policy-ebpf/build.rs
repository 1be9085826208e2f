//! Rebuild when the bpf-linker binary changes (it is an undeclared build
//! input: cargo cannot see it otherwise).
fn main() {
    if let Ok(linker) = which::which("bpf-linker") {
        println!("cargo:rerun-if-changed={}", linker.display());
    }
}
