//! What changed between the held item and a new one, for the outbox.
//!
//! Reading rule "On a feed item's event": `data.changes` is always empty, so compare parts by
//! `part_id` and `part_version` to learn what changed; `data.op` is a hint to decide nothing by.

use relay_wire::PartRef;

/// Part ids that appeared, changed version, or disappeared between two versions of an item.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PartsDiff {
    /// In the new item, not in the held one (every part, when nothing or a tombstone is held).
    pub added: Vec<String>,
    /// In both, with another `part_version` (normally a higher one).
    pub changed: Vec<String>,
    /// In the held item, not in the new one.
    pub removed: Vec<String>,
}

impl PartsDiff {
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.changed.is_empty() && self.removed.is_empty()
    }
}

/// Compares parts by `part_id` and `part_version` (rule "On a feed item's event": changes is
/// always empty; compare parts to learn what changed). `held` is `None` when nothing, or only a
/// tombstone, is held. Lists keep the order of the item they come from (added and changed: the
/// new item's; removed: the held item's). A part version that differs in either direction is
/// "changed": the rule names no other meaning for it.
pub fn diff_parts(held: Option<&[PartRef]>, new: &[PartRef]) -> PartsDiff {
    let held = held.unwrap_or(&[]);
    let version_in = |parts: &[PartRef], id: &str| {
        parts
            .iter()
            .find(|p| p.part_id == id)
            .map(|p| p.part_version)
    };
    let mut diff = PartsDiff::default();
    for (i, part) in new.iter().enumerate() {
        if new[..i].iter().any(|p| p.part_id == part.part_id) {
            continue; // a repeated id counts once
        }
        match version_in(held, &part.part_id) {
            None => diff.added.push(part.part_id.clone()),
            Some(v) if v != part.part_version => diff.changed.push(part.part_id.clone()),
            Some(_) => {}
        }
    }
    for (i, part) in held.iter().enumerate() {
        if held[..i].iter().any(|p| p.part_id == part.part_id) {
            continue;
        }
        if version_in(new, &part.part_id).is_none() {
            diff.removed.push(part.part_id.clone());
        }
    }
    diff
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(id: &str, v: i64) -> PartRef {
        PartRef {
            part_id: id.into(),
            part_version: v,
        }
    }

    #[test]
    fn feed_item_event_rule_compare_parts_by_id_and_version() {
        let held = [p("flash:9", 1), p("flash:11", 1), p("story:7101", 1)];
        let new = [p("flash:11", 1), p("flash:12", 1), p("story:7101", 2)];
        let diff = diff_parts(Some(&held), &new);
        assert_eq!(diff.added, vec!["flash:12"]);
        assert_eq!(diff.changed, vec!["story:7101"]);
        assert_eq!(diff.removed, vec!["flash:9"]);
    }

    #[test]
    fn feed_item_event_rule_nothing_held_means_every_part_is_added() {
        let new = [p("a", 1), p("b", 2)];
        let diff = diff_parts(None, &new);
        assert_eq!(diff.added, vec!["a", "b"]);
        assert!(diff.changed.is_empty() && diff.removed.is_empty());
        assert!(diff_parts(Some(&new), &new).is_empty());
    }
}
