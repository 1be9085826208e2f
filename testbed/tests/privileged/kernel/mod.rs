//! The classifier on the real kernel through BPF_PROG_TEST_RUN: crafted
//! packets against chosen map content, judged by verdict, reason,
//! counters and events.
mod conntrack_share;
mod differential;
mod flow_records;
mod hardening;
mod map_reads;
mod node_traffic;
mod pod_range_guard;
mod port_lengths;
mod program_load;
mod services;
mod test_run;
