//! Cross-crate tests, one binary (faster to link than one per file).

mod api;
mod api_hostile;
mod convergence;
mod copy;
mod demo;
mod hostile_tenant;
mod ingest_answers;
mod ingest_hostile;
mod ingest_outage;
mod ingest_replicas;
mod ingest_vector;
mod pipeline;
mod publisher;
mod registration_changes;
mod restore;
mod scale_out;
mod sequencer_apply;
mod sequencer_ownership;
mod sequencer_quarantine;
mod sequencer_reload;
mod stack;
mod store_pool;
mod tenant_broker;
mod tls_broker;
mod tls_support;
mod upstream_tls;
