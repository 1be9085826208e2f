//! `policy-agent`: enforces Kubernetes NetworkPolicy on this node.
mod cli;

fn main() -> std::process::ExitCode {
    cli::main()
}
