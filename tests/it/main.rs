//! Cross-crate tests, one binary (faster to link than one per file).

mod api;
mod api_hostile;
mod convergence;
mod copy;
mod ingest_answers;
mod ingest_outage;
mod ingest_replicas;
mod ingest_vector;
mod pipeline;
mod publisher;
mod sequencer_apply;
mod sequencer_ownership;
mod sequencer_reload;
mod store_pool;
