//! The hand-off between the chained CNI plugin and the agent.
//!
//! One request per connection on the agent's unix socket: the plugin
//! writes one JSON line ([`Request`]) and reads one JSON line back
//! ([`Response`]). The agent answers an ADD only once the pod's endpoint
//! is written and its interface attached (or with an error), so the
//! plugin's ADD returns only for a pod enforced from its first packet.
pub mod protocol;
