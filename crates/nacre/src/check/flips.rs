//! Whether the scrub found every byte the `corrupt` schedule flipped in live data. After the run,
//! every data node completes two more scrub passes (so one started after the last flip), then each
//! flipped block is read from the replica that holds it (`FetchBlocks`, which verifies the block
//! and repairs nothing): a block that still fails its CRC was missed. A flip past its extent's end
//! (in a recycled file's old bytes) or in an extent deleted since is not in live data.

use std::time::{Duration, Instant};

use nacre_api::data::{DataError, FetchBlocks, FetchBlocksRequest};
use nacre_msgr::{CallOptions, Client, Payload};
use nacre_types::{ExtentId, PartitionId};
use serde::Serialize;

use super::harness::Harness;

/// One flipped byte: the block that holds it on one replica.
#[derive(Clone, Debug)]
pub struct Flip {
    /// The harness's index of the data node.
    pub node: usize,
    pub partition: PartitionId,
    pub extent: ExtentId,
    pub block: u64,
}

/// What became of the flipped blocks.
#[derive(Debug, Default, Serialize)]
pub struct FlipReport {
    /// Flipped blocks still in live data, now verifying (repaired by the scrub or a read, or
    /// rewritten whole).
    pub repaired: usize,
    /// Flips past their extent's end or in a deleted extent.
    pub not_live: usize,
    /// Flipped blocks in live data that still fail their CRC (must be none).
    pub missed: Vec<String>,
    /// Blocks that could not be asked about, and why.
    pub unknown: Vec<String>,
    /// Data nodes that did not complete two scrub passes within the wait.
    pub scrub_incomplete: Vec<String>,
}

/// Longest wait for the data nodes' scrub passes after the run.
const PASSES_WITHIN: Duration = Duration::from_secs(180);
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// Waits for two scrub passes on every data node, then asks about every flip.
pub async fn verify(h: &Harness, client: &Client, flips: &[Flip]) -> FlipReport {
    let mut report = FlipReport::default();
    if flips.is_empty() {
        return report;
    }
    let mut nodes: Vec<usize> = flips.iter().map(|f| f.node).collect();
    nodes.sort_unstable();
    nodes.dedup();
    const PASS: &str = "scrub pass done";
    let before: Vec<(usize, usize)> = nodes.iter().map(|&k| (k, h.log_matches(k, PASS))).collect();
    let deadline = Instant::now() + PASSES_WITHIN;
    loop {
        let behind: Vec<usize> = before
            .iter()
            .filter(|&&(k, n)| h.log_matches(k, PASS) < n + 2)
            .map(|&(k, _)| k)
            .collect();
        if behind.is_empty() {
            break;
        }
        if Instant::now() >= deadline {
            report.scrub_incomplete = behind.iter().map(|&k| h.nodes[k].name.clone()).collect();
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let opts = CallOptions {
        timeout: Some(CALL_TIMEOUT),
        ..CallOptions::default()
    };
    for f in flips {
        let n = &h.nodes[f.node];
        let what = format!("{} {} {} block {}", n.name, f.partition, f.extent, f.block);
        let req = FetchBlocksRequest {
            partition: f.partition,
            extent: f.extent,
            first: f.block,
            count: 1,
        };
        match client
            .call_with::<FetchBlocks>(&n.addr, &req, Payload::none(), opts)
            .await
        {
            Ok((Ok(_), data)) if data.bytes.is_empty() => report.not_live += 1,
            Ok((Ok(_), _)) => report.repaired += 1,
            Ok((Err(DataError::NotFound(_) | DataError::OutOfRange { .. }), _)) => {
                report.not_live += 1;
            }
            Ok((Err(DataError::Corrupt { .. }), _)) => report.missed.push(what),
            Ok((Err(e), _)) => report.unknown.push(format!("{what}: {e}")),
            Err(e) => report.unknown.push(format!("{what}: {e}")),
        }
    }
    report
}
