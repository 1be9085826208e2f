//! `policy-cni`: run by the container runtime as a CNI plugin (the
//! `CNI_*` environment and the config on stdin), or by the DaemonSet as
//! `policy-cni install [--watch]` / `policy-cni uninstall`.
fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let status = match args.first().map(String::as_str) {
        Some("install" | "uninstall") => policy_cni::install::main(&args),
        Some("--help" | "-h") => {
            eprintln!("{}", policy_cni::install::USAGE);
            0
        }
        _ => policy_cni::plugin::main(),
    };
    std::process::exit(status);
}
