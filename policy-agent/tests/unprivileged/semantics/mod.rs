//! The compiler's output judged by the classifier's model, case by case,
//! against what the NetworkPolicy API says.
mod budget;
mod explain;
mod invalid;
mod ipblock;
mod isolation;
mod lifecycle;
mod ports;
mod selectors;
