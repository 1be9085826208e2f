//! `policy-cni`: run by the container runtime as a CNI plugin (the
//! `CNI_*` environment and the config on stdin).
fn main() {
    std::process::exit(policy_cni::plugin::main());
}
