//! The chained CNI plugin that holds a pod's ADD until the local agent
//! enforces it, its installer, and the hand-off protocol the agent serves.
//!
//! One request per connection on the agent's unix socket: the plugin
//! writes one JSON line ([`protocol::Request`]) and reads one JSON line
//! back ([`protocol::Response`]). The agent answers an ADD only once the
//! pod's endpoint is written and its interface attached (or with an
//! error), so the plugin's ADD returns only for a pod enforced from its
//! first packet.
pub mod install;
pub mod plugin;
pub mod protocol;
