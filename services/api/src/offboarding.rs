//! The purge that finishes every delete (relay-store's `offboard`): the control plane marks an
//! endpoint or a tenant in the request, and this task deletes its rows, a batch at a time, then
//! the endpoint's row; for a tenant, once its endpoints are gone, its broker user and queues on
//! the relay's broker and then its row. It works from what Postgres holds marked, so a restart
//! (or another control plane) finishes what a crash interrupted, and it is woken by each
//! delete rather than waiting for its next round.

use std::sync::Arc;
use std::time::Duration;

use relay_store::offboard;
use sqlx::PgPool;
use tokio::sync::Notify;

use crate::broker::BrokerAccess;
use crate::error::ApiError;

/// How often the purge looks for marked endpoints and tenants when no delete wakes it: the
/// safety net for a wake-up lost to a crash between the mark and the purge.
const PURGE_INTERVAL: Duration = Duration::from_secs(10);
/// Rows of each bulky table deleted per statement: a transaction of a few milliseconds, short
/// enough that the front tier's and the sequencer's writes on other endpoints never wait long
/// behind one.
const PURGE_BATCH: i64 = 5_000;
/// Marked endpoints taken per round.
const ENDPOINTS_PER_ROUND: i64 = 100;

/// Purges until aborted; `wake` starts a round at once.
pub async fn run(pool: PgPool, broker: BrokerAccess, http: reqwest::Client, wake: Arc<Notify>) {
    loop {
        if let Err(error) = round(&pool, &broker, &http).await {
            tracing::warn!(%error, "purging deleted endpoints and tenants; trying again");
        }
        tokio::select! {
            () = wake.notified() => {}
            () = tokio::time::sleep(PURGE_INTERVAL) => {}
        }
    }
}

/// One round: every marked endpoint purged and deleted, then every marked tenant left with no
/// endpoint removed from the broker and deleted.
async fn round(
    pool: &PgPool,
    broker: &BrokerAccess,
    http: &reqwest::Client,
) -> Result<(), ApiError> {
    loop {
        let marked = offboard::deleting_endpoints(pool, ENDPOINTS_PER_ROUND).await?;
        if marked.is_empty() {
            break;
        }
        for (tenant, endpoint) in marked {
            let mut rows = 0;
            loop {
                let deleted = offboard::purge_rows(pool, endpoint, PURGE_BATCH).await?;
                if deleted == 0 {
                    break;
                }
                rows += deleted;
            }
            if offboard::finish_endpoint(pool, endpoint).await? {
                tracing::info!(%tenant, %endpoint, rows, "endpoint deleted");
            }
        }
    }
    for (tenant, empty) in offboard::deleting_tenants(pool).await? {
        if !empty {
            continue;
        }
        // The broker first: once the row is gone nothing would remind us of its user.
        broker.revoke(http, tenant).await?;
        broker.delete_queues(http, tenant).await?;
        if offboard::finish_tenant(pool, tenant).await? {
            tracing::info!(%tenant, "tenant deleted");
        }
    }
    Ok(())
}
