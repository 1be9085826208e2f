//! The chained CNI plugin with Debian's real plugins, and the agent's
//! side of the hand-off.
mod agent;
mod plugin;
