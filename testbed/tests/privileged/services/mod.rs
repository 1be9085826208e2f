//! Services on real traffic: the kube-proxy stand-in in iptables,
//! nftables and IPVS mode, with and without the agents.
mod addresses;
mod basics;
mod changes;
mod hairpin;
mod ipvs;
mod masquerade;
mod simulated;
