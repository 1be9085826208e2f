//! Rebuild when the bpf-linker binary changes (it is an undeclared build
//! input: cargo cannot see it otherwise), and keep the policy probe and
//! the flow judgement global functions.
fn main() {
    // Kept global, so the verifier checks each once (see their comments). Only
    // bpf-linker knows the flag: the host build of this crate (cargo test
    // --workspace) links with cc.
    if std::env::var("CARGO_CFG_TARGET_ARCH").is_ok_and(|a| a == "bpf") {
        println!("cargo:rustc-link-arg=--export=probe_peer,judge_flow");
    }
    if let Ok(linker) = which::which("bpf-linker") {
        println!("cargo:rerun-if-changed={}", linker.display());
    }
}
