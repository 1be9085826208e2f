//! The chained CNI plugin (to be written: see the crate docs).
fn main() {
    std::process::exit(1);
}
