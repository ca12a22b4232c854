//! Grouped mode (vLLM's per-group events): the map keeps each group's copies of a page and
//! claims a page only where vLLM's hybrid rule would reuse it; the claims, their withdrawal and
//! the settling walk live here, beside the legacy store and removal paths of the parent module
//! that they share the page map with.

use super::*;

/// Claim changes found by [`ReverseMap::settle`].
#[derive(Debug, Default)]
struct Settled {
    added: Vec<Entry>,
    evicted: Vec<Entry>,
    retiered: Vec<Entry>,
}

/// Grouped mode (vLLM per-group events): copies per group, claims under the hybrid rule.
impl ReverseMap {
    pub(super) fn store_grouped(&mut self, ev: &BlockStored, adapter: &str) -> Stored {
        let mut out = Stored::default();
        if !self.grouped {
            self.enter_grouped();
        }
        let group_index = ev.group_idx.unwrap_or(0);
        let group = Group::from_wire(
            ev.kv_cache_spec_kind.as_deref(),
            ev.kv_cache_spec_sliding_window,
            ev.block_size,
            self.attention_chunk,
        );
        out.group_kind = Some(group.kind);
        let rules_changed = self.groups.learn(group_index, group);
        let touched = self.key_grouped(ev, adapter, group_index, &mut out);
        let settled = if rules_changed {
            self.settle_all()
        } else {
            // A page's claim depends on the pages within its group rules' reach before it, so
            // a change in one group reaches that far after the page (full attention: all).
            let reach = group.rule.reach();
            let starts: Vec<Start> = touched.into_iter().map(|h| (h, reach)).collect();
            self.settle(&starts)
        };
        out.entries.extend(settled.added);
        out.entries.extend(settled.retiered);
        out.evicted = settled.evicted;
        out
    }

    /// Records the event's copies; returns the pages that gained one.
    fn key_grouped(
        &mut self,
        ev: &BlockStored,
        adapter: &str,
        group: u32,
        out: &mut Stored,
    ) -> Vec<Vec<u8>> {
        let mut touched = Vec::new();
        let Some(EventCopy {
            page_size,
            tier,
            media_key,
        }) = event_copy(ev, out)
        else {
            return touched;
        };
        let pages = ev.block_hashes.len();
        let key = (group, media_key);
        let lookahead_of = |i: usize| -> u64 {
            ev.lookahead_tokens
                .as_ref()
                .and_then(|l| l.get(i))
                .map_or(0, |&n| n as u64)
        };
        // vLLM leaves null (sliding-window, Mamba) and masked blocks out of `block_hashes` but
        // not out of `token_ids`: with at least one whole block of tokens more than hashes, the
        // hashes cannot be placed on the tokens, so only pages already known by hash (from
        // another group) take the copy. A group with larger blocks than another known group
        // does the same: its block hash is the finer group's hash at the same boundary
        // (`BlockHashListWithBlockSize`), so its copy goes to the finer page ending there and
        // the chain keeps the finer pages.
        let coarser = self.groups.has_finer_than(page_size as u64);
        if coarser || ev.token_ids.len() >= page_size.saturating_mul(pages + 1) {
            for (i, hash) in ev.block_hashes.iter().enumerate() {
                match self.pages.get_mut(hash) {
                    Some(page) => {
                        if add_copy(page, &key, tier, lookahead_of(i)) {
                            touched.push(hash.clone());
                        }
                    }
                    None => {
                        out.orphan_pages += 1;
                        self.park(hash, &key, tier);
                    }
                }
            }
            self.note_lookahead(ev);
            return touched;
        }
        let Some(mut boundary) = self.chain_start(ev.parent_block_hash.as_ref()) else {
            out.orphan_pages = pages;
            for hash in &ev.block_hashes {
                self.park(hash, &key, tier);
            }
            return touched;
        };
        let keyed_from = first_keyed(ev);
        let mut parent = ev.parent_block_hash.clone();
        for (i, hash) in ev.block_hashes.iter().enumerate() {
            if keyed_from.is_some_and(|k| i >= k) {
                out.keyed_pages = pages - i;
                break;
            }
            if let Some(known) = self.pages.get_mut(hash) {
                // A copy the map already has (vLLM re-reports prefix-cache hits) changes no
                // claim: the page and everything after it are left alone.
                if add_copy(known, &key, tier, lookahead_of(i)) {
                    touched.push(hash.clone());
                }
                boundary = known.boundary.clone();
                parent = Some(hash.clone());
                continue;
            }
            let owned = boundary.complete(
                &ev.token_ids[i * page_size..(i + 1) * page_size],
                self.block_size,
            );
            if let Some(p) = parent.as_ref().and_then(|p| self.pages.get_mut(p)) {
                p.children.push(hash.clone());
            }
            let mut copies = self.parked.remove(hash).unwrap_or_default();
            copies.insert(key.clone(), tier);
            self.pages.insert(
                hash.clone(),
                Page {
                    parent: parent.clone(),
                    children: Vec::new(),
                    boundary: boundary.clone(),
                    owned,
                    adapter: adapter.to_string(),
                    media: BTreeMap::new(),
                    page_tokens: page_size as u64,
                    copies,
                    lookahead: lookahead_of(i),
                    claimable: false,
                    on_claimed_path: false,
                    reported: None,
                    held_from_start: 0,
                },
            );
            parent = Some(hash.clone());
            touched.push(hash.clone());
        }
        self.note_lookahead(ev);
        touched
    }

    /// Bound on parked hashes: beyond it new ones are not parked (an under-claim at worst).
    const MAX_PARKED: usize = 1 << 16;

    fn park(&mut self, hash: &[u8], key: &(u32, String), tier: Tier) {
        if self.parked.len() >= Self::MAX_PARKED && !self.parked.contains_key(hash) {
            return;
        }
        self.parked
            .entry(hash.to_vec())
            .or_default()
            .insert(key.clone(), tier);
    }

    fn note_lookahead(&mut self, ev: &BlockStored) {
        if let Some(most) = ev.lookahead_tokens.as_ref().and_then(|l| l.iter().max()) {
            self.max_lookahead = self.max_lookahead.max(*most as u64);
        }
    }

    /// Switches from legacy to grouped mode: pages stored without a group become group 0's
    /// copies, reported at their hottest tier as before.
    fn enter_grouped(&mut self) {
        self.grouped = true;
        for page in self.pages.values_mut() {
            for (key, &tier) in &page.media {
                page.copies.insert((0, key.clone()), tier);
            }
            page.claimable = !page.media.is_empty();
            page.on_claimed_path = page.claimable;
            page.reported = page.hottest();
        }
    }

    pub(super) fn remove_grouped(
        &mut self,
        engine_hashes: &[Vec<u8>],
        removal: Removal<'_>,
    ) -> Removed {
        let mut out = Removed::default();
        let key = removal
            .medium
            .map(|m| tier::copy_key(Some(m), removal.locality, removal.ownership));
        let remote_only = removal.medium.is_none() && tier::is_remote(removal.locality);
        let mut touched = Vec::new();
        let mut removed_groups: Vec<(Vec<u8>, u32)> = Vec::new();
        let named = |group: u32, copy: &str| {
            removal.group.is_none_or(|g| g == group)
                && match &key {
                    Some(k) => k == copy,
                    None => !remote_only || copy.starts_with("REMOTE:"),
                }
        };
        for hash in engine_hashes {
            if let Some(parked) = self.parked.get_mut(hash) {
                parked.retain(|(group, copy), _| !named(*group, copy));
                if parked.is_empty() {
                    self.parked.remove(hash);
                }
            }
            let Some(page) = self.pages.get_mut(hash) else {
                continue;
            };
            let mut gone = Vec::new();
            page.copies.retain(|(group, copy), _| {
                let hit = named(*group, copy);
                if hit {
                    gone.push(*group);
                }
                !hit
            });
            if !gone.is_empty() {
                touched.push(hash.clone());
                removed_groups.extend(gone.into_iter().map(|g| (hash.clone(), g)));
            }
        }
        let starts: Vec<Start> = removed_groups
            .iter()
            .map(|(hash, group)| {
                let reach = self.groups.get(*group).and_then(|g| g.rule.reach());
                (hash.clone(), reach)
            })
            .collect();
        let mut settled = self.settle(&starts);
        for (hash, group) in removed_groups {
            let kind = self.groups.get(group).map_or(Kind::Other, |g| g.kind);
            let kept = self.pages.get(&hash).is_some_and(|p| p.reported.is_some());
            out.group_copies.push((kind, kept));
        }
        // Forget pages no group holds and nothing after them needs, then let their ancestors'
        // lookahead coverage catch up.
        let parents = self.collect_garbage(&touched);
        if self.max_lookahead > 0 && !parents.is_empty() {
            let starts: Vec<Start> = parents.into_iter().map(|h| (h, Some(0))).collect();
            let more = self.settle(&starts);
            settled.evicted.extend(more.evicted);
            settled.retiered.extend(more.retiered);
            settled.added.extend(more.added);
        }
        out.evicted = settled.evicted;
        out.retiered = settled.retiered;
        out.retiered.extend(settled.added);
        out
    }

    /// Forgets every page in `hashes` (and, upwards, its ancestors) that no group holds, has
    /// no child and is not reported. Returns the surviving parents of forgotten pages.
    fn collect_garbage(&mut self, hashes: &[Vec<u8>]) -> Vec<Vec<u8>> {
        let mut parents = Vec::new();
        for hash in hashes {
            let mut current = Some(hash.clone());
            while let Some(h) = current.take() {
                let Some(page) = self.pages.get(&h) else {
                    break;
                };
                if !page.copies.is_empty() || !page.children.is_empty() || page.reported.is_some() {
                    break;
                }
                let parent = page.parent.clone();
                self.pages.remove(&h);
                if let Some(p) = parent.as_ref().and_then(|p| self.pages.get_mut(p)) {
                    p.children.retain(|c| c != &h);
                    parents.push(parent.clone().unwrap_or_default());
                    current = parent;
                }
            }
        }
        parents.retain(|p| self.pages.contains_key(p));
        parents
    }

    /// Re-evaluates every page (the rule set changed).
    fn settle_all(&mut self) -> Settled {
        let roots: Vec<Start> = self
            .pages
            .iter()
            .filter(|(_, p)| {
                p.parent
                    .as_ref()
                    .is_none_or(|parent| !self.pages.contains_key(parent))
            })
            .map(|(h, _)| (h.clone(), None))
            .collect();
        self.settle(&roots)
    }

    /// Re-evaluates the claims of each start page and the pages after it within its reach, the
    /// pages whose lookahead they may now cover, and the reported path before them; returns
    /// the changes.
    fn settle(&mut self, changed: &[Start]) -> Settled {
        let mut starts: Vec<Start> = Vec::new();
        for (hash, reach) in changed {
            if !self.pages.contains_key(hash) {
                continue;
            }
            starts.push((hash.clone(), *reach));
            if self.max_lookahead > 0 {
                // Ancestors whose lookahead tokens this page may complete.
                let end = self.pages[hash].end_tokens();
                let mut up = self.pages[hash].parent.clone();
                while let Some(a) = up {
                    let Some(page) = self.pages.get(&a) else {
                        break;
                    };
                    if end.saturating_sub(page.end_tokens()) > self.max_lookahead {
                        break;
                    }
                    starts.push((a.clone(), Some(0)));
                    up = page.parent.clone();
                }
            }
        }
        // Chain order (a parent ends before its children), so a start's parent is settled
        // before the start's holdings are read from it.
        starts.sort_by_key(|(h, _)| self.pages.get(h).map_or(0, Page::end_tokens));
        // Phase 1: claimability of each start and the pages after it within reach, walking
        // down with the groups' holdings along the chain. A page reached again with a longer
        // reach is walked again (its subtree may need it).
        let mut reached: HashMap<Vec<u8>, Option<u64>> = HashMap::new();
        let mut order: Vec<Vec<u8>> = Vec::new();
        let covers = |have: Option<u64>, want: Option<u64>| match (have, want) {
            (None, _) => true,
            (Some(_), None) => false,
            (Some(h), Some(w)) => h >= w,
        };
        for (start, reach) in &starts {
            let Some(start_end) = self.pages.get(start).map(Page::end_tokens) else {
                continue;
            };
            let limit = reach.map(|r| start_end.saturating_add(r));
            if reached.get(start).is_some_and(|&have| covers(have, limit)) {
                continue;
            }
            let above = self.walk_above(start);
            let mut stack = vec![(start.clone(), above, limit)];
            while let Some((hash, walk, limit)) = stack.pop() {
                if reached.get(&hash).is_some_and(|&have| covers(have, limit)) {
                    continue;
                }
                reached.insert(hash.clone(), limit);
                let Some(page) = self.pages.get(&hash) else {
                    continue;
                };
                let walk = self.step(&walk, page);
                let claimable = !page.copies.is_empty()
                    && self.accepted(&walk, page)
                    && self.lookahead_covered(&hash);
                let children: Vec<Vec<u8>> = page
                    .children
                    .iter()
                    .filter(|c| {
                        let end = self.pages.get(*c).map_or(u64::MAX, Page::end_tokens);
                        limit.is_none_or(|l| end < l)
                    })
                    .cloned()
                    .collect();
                if let Some(page) = self.pages.get_mut(&hash) {
                    page.claimable = claimable;
                    page.held_from_start = walk.all;
                }
                order.push(hash);
                stack.extend(children.into_iter().map(|c| (c, walk.clone(), limit)));
            }
        }
        order.sort();
        order.dedup();
        let starts: Vec<Vec<u8>> = starts.into_iter().map(|(h, _)| h).collect();
        // Phase 2: the claimed path, deepest pages first (a child ends after its parent).
        order.sort_by_key(|h| std::cmp::Reverse(self.pages.get(h).map_or(0, Page::end_tokens)));
        let mut candidates = order.clone();
        for hash in &order {
            self.refresh_path_flag(hash);
        }
        // The pages before each start: walk up while the flag changes.
        for start in &starts {
            let mut up = self.pages.get(start).and_then(|p| p.parent.clone());
            while let Some(a) = up {
                if !self.pages.contains_key(&a) {
                    break;
                }
                let changed = self.refresh_path_flag(&a);
                candidates.push(a.clone());
                if !changed {
                    break;
                }
                up = self.pages.get(&a).and_then(|p| p.parent.clone());
            }
        }
        // Phase 3: report the differences, in chain order.
        candidates.sort_by_key(|h| self.pages.get(h).map_or(0, Page::end_tokens));
        let mut out = Settled::default();
        let mut seen = HashSet::new();
        for hash in candidates {
            if !seen.insert(hash.clone()) {
                continue;
            }
            let Some(page) = self.pages.get_mut(&hash) else {
                continue;
            };
            let now = page.on_claimed_path.then(|| page.grouped_tier());
            match (page.reported, now) {
                (None, Some(t)) => out.added.extend(page.entries(t)),
                (Some(before), None) => out.evicted.extend(page.entries(before)),
                (Some(before), Some(t)) if before != t => out.retiered.extend(page.entries(t)),
                _ => {}
            }
            page.reported = now;
        }
        out
    }

    /// Recomputes whether a page is on a claimed path from its own claim and its children's
    /// flags; true when the flag changed.
    fn refresh_path_flag(&mut self, hash: &[u8]) -> bool {
        let Some(page) = self.pages.get(hash) else {
            return false;
        };
        let flag = page.claimable
            || page
                .children
                .iter()
                .any(|c| self.pages.get(c).is_some_and(|p| p.on_claimed_path));
        match self.pages.get_mut(hash) {
            Some(page) if page.on_claimed_path != flag => {
                page.on_claimed_path = flag;
                true
            }
            _ => false,
        }
    }

    /// The groups' holdings along the chain up to the parent of `hash`: the parent's
    /// held-from-start bits, and each group's run walked back at most as far as any rule looks.
    fn walk_above(&self, hash: &[u8]) -> Walk {
        let groups = self.groups.len();
        let parent = self
            .pages
            .get(hash)
            .and_then(|p| p.parent.as_ref())
            .and_then(|p| self.pages.get(p));
        let Some(parent) = parent else {
            return Walk {
                all: u64::MAX,
                run: vec![0; groups],
            };
        };
        let horizon = self
            .groups
            .iter()
            .filter_map(|(_, g)| g.rule.reach())
            .max()
            .unwrap_or(0);
        let mut run = vec![0u64; groups];
        let mut open = vec![true; groups];
        let mut current = Some(parent);
        let mut walked = 0u64;
        while let Some(page) = current {
            if walked >= horizon || !open.iter().any(|&o| o) {
                break;
            }
            for (i, (group, _)) in self.groups.iter().enumerate() {
                if open[i] {
                    if page.holds(group) {
                        run[i] = run[i].saturating_add(page.page_tokens);
                    } else {
                        open[i] = false;
                    }
                }
            }
            walked = walked.saturating_add(page.page_tokens);
            current = page.parent.as_ref().and_then(|p| self.pages.get(p));
        }
        Walk {
            all: parent.held_from_start,
            run,
        }
    }

    /// The holdings after one more page.
    fn step(&self, walk: &Walk, page: &Page) -> Walk {
        let mut next = walk.clone();
        for (i, (group, _)) in self.groups.iter().enumerate() {
            let held = page.holds(group);
            if i < 64 && !held {
                next.all &= !(1u64 << i);
            }
            if let Some(run) = next.run.get_mut(i) {
                *run = if held {
                    run.saturating_add(page.page_tokens)
                } else {
                    0
                };
            }
        }
        next
    }

    /// Whether every known group accepts the prefix ending at `page` (holdings `walk`
    /// include the page).
    fn accepted(&self, walk: &Walk, page: &Page) -> bool {
        let end = page.end_tokens();
        self.groups.iter().enumerate().all(|(i, (group, g))| {
            // Beyond 64 groups the held-from-start bit is unknown: refuse (never over-claim).
            let all = i < 64 && walk.all & (1u64 << i) != 0;
            let run = walk.run.get(i).copied().unwrap_or(0);
            g.rule.accepts(end, page.holds(group), all, run)
        })
    }

    /// Whether the map holds the chain's next tokens that the page's hash covers.
    fn lookahead_covered(&self, hash: &[u8]) -> bool {
        let Some(page) = self.pages.get(hash) else {
            return false;
        };
        if page.lookahead == 0 {
            return true;
        }
        let target = page.end_tokens().saturating_add(page.lookahead);
        let mut current = page;
        while current.end_tokens() < target {
            // Any child: the page's hash fixes its lookahead tokens, so every child continues
            // with them.
            match current.children.first().and_then(|c| self.pages.get(c)) {
                Some(child) => current = child,
                None => return false,
            }
        }
        true
    }
}
