//! What the unprivileged tests share.
#![allow(dead_code, reason = "each test module uses a part")]

pub mod ci;
pub mod cnp_oracle;
pub mod netfilter;
pub mod oracle;
pub mod world;
