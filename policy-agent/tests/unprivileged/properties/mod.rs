//! Property tests over random clusters and policies.
mod fuzz;
mod incremental;
mod semantics;
