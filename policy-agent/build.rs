//! Builds the kernel classifier (`policy-ebpf`) with aya-build, as
//! aya-template does, so the object is embedded in the agent binary.
use anyhow::{Context as _, anyhow};
use aya_build::{Package, Toolchain};

fn main() -> anyhow::Result<()> {
    let cargo_metadata::Metadata { packages, .. } = cargo_metadata::MetadataCommand::new()
        .no_deps()
        .exec()
        .context("cargo metadata")?;
    // The classifier is built from policy-common too: a change there
    // (a layout, a shared decision helper) must rebuild it, which
    // aya-build's own rerun list (the eBPF package) does not say.
    if let Some(common) = packages.iter().find(|p| p.name.as_str() == "policy-common")
        && let Some(dir) = common.manifest_path.parent()
    {
        println!("cargo:rerun-if-changed={dir}");
    }
    let ebpf = packages
        .into_iter()
        .find(|p| p.name.as_str() == "policy-ebpf")
        .ok_or_else(|| anyhow!("policy-ebpf package not found"))?;
    let root_dir = ebpf
        .manifest_path
        .parent()
        .ok_or_else(|| anyhow!("policy-ebpf manifest has no parent"))?
        .as_str()
        .to_owned();
    let package = Package {
        name: ebpf.name.as_str(),
        root_dir: &root_dir,
        ..Default::default()
    };
    if std::env::var_os("AYA_BUILD_SKIP")
        .is_some_and(|v| v == "1" || v.eq_ignore_ascii_case("true"))
    {
        // Semantics-only builds: leave an empty object; loading it fails
        // with a clear error instead of the build failing here.
        let out = std::path::PathBuf::from(std::env::var_os("OUT_DIR").context("OUT_DIR")?);
        std::fs::write(out.join("policy-ebpf"), []).context("write empty object")?;
    }
    aya_build::build_ebpf([package], Toolchain::default())
}
