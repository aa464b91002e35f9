"""Mirror requests: the engine's requests of the previous step as each EP worker's ModelRunner reads them.

`StepEncoder` (engine side) turns each rank's part of a step into a message of what changed since the previous
step; `Mirrors` (worker side) applies it. Each step message (distributed/messages.py) brings the requests new to this rank whole and, for every item, what
changed since the previous step; `apply` advances the mirrors and returns the step's ScheduledBatch, the
engine's plan item for item (its flags too: a mirror lacks the engine's in-flight tokens). A request absent from
a step is forgotten here as in the engine, which sends it whole if it returns; a forgotten mirror is marked
finished, which is what gives its row of the decode CUDA graphs' page table back (cuda_graph.PageTable):
without it a long-lived worker runs out of rows after 2 * max_num_seqs requests and decodes eagerly from then
on.
"""
from __future__ import annotations

from typing import Callable

import torch

from deepinfer_rt.distributed.messages import COLUMNS, NewReq, StepItems, StepMsg
from deepinfer_rt.request import Req
from deepinfer_rt.scheduler.batch import ScheduledBatch, ScheduledReq

_ITEM_COLUMNS = COLUMNS[:-2]  # the counts of new token ids and pages are the packer's


class StepEncoder:
    def __init__(self, bitmask: Callable[[Req], torch.Tensor]):
        self.bitmask = bitmask
        """Fills a constrained request's grammar bitmask row (the matchers stay in the engine process)."""
        self._sent: dict[int, tuple[int, int, int, int, int]] = {}
        """rid -> (tokens, retractions, pages, last page, page cuts) the workers' mirror holds after the previous
        step."""

    def encode(self, parts: list[ScheduledBatch], is_overlapped: bool, has_spec: bool) -> list[StepMsg]:
        """Each rank's message of one step (a part without items: an empty step). With speculation rejected
        drafts' pages are cut in place (`Req.cut_pages`) and may be regrown with other pages: the mirror keeps
        the head before the cut and takes the rest anew (see `_pages_from`)."""
        sent: dict[int, tuple[int, int, int, int, int]] = {}
        msgs = [self._part(part, sent, is_overlapped, has_spec) for part in parts]
        self._sent = sent
        return msgs

    def _part(self, batch: ScheduledBatch, sent: dict, is_overlapped: bool, has_spec: bool) -> StepMsg:
        msg = StepMsg(kv_copies=list(batch.kv_copies), is_overlapped=is_overlapped)
        if not batch.items:
            return msg
        rows, new_tokens, new_pages, bitmasks, drafts = [], [], [], {}, {}
        for i, item in enumerate(batch.items):
            req = item.req
            prev = self._sent.get(req.rid)
            if prev is None:
                msg.new_reqs.append(NewReq(req.rid, req.prompt_ids, list(req.token_ids), req.params, req.seed))
                prev = (len(req.token_ids), -1, 0, -1, req.num_page_cuts)
            num_known = prev[0]
            num_pages = _pages_from(req, *prev[1:], has_spec)
            rows.append((req.rid, item.start, item.num_new_tokens, num_pages, len(req.prompt_logprobs),
                         req.num_inflight_tokens, item.is_sampling, item.wants_prompt_logprobs))  # _ITEM_COLUMNS
            new_tokens.append(req.token_ids[num_known:])
            new_pages.append(req.pages[num_pages:])
            if item.is_sampling and req.grammar is not None:
                bitmasks[i] = self.bitmask(req)
            if item.draft_tokens:
                drafts[i] = item.draft_tokens
            sent[req.rid] = (len(req.token_ids), req.num_retractions, len(req.pages),
                             req.pages[-1] if req.pages else -1, req.num_page_cuts)
        columns = {name: list(values) for name, values in zip(_ITEM_COLUMNS, zip(*rows))}
        msg.items = StepItems.pack(columns, new_tokens, new_pages, bitmasks, drafts)
        return msg


def _pages_from(req: Req, retractions: int, num_pages: int, last_page: int, num_cuts: int, has_spec: bool) -> int:
    """How many of req's pages the mirror still holds as they are, of the num_pages it was sent: the new pages
    go from there (0: all of them again). A retraction gives every page back. A cut in place (speculation's
    rejected drafts) keeps the pages before it; regrown, the list may end in its old last page with another
    page before it (two pages cut, [.., C, D] -> [.., Z, D] when the free list held Z above D), so a cut is
    known by its count, not by the last page. Two cuts since: the lower one is unknown, all again. The last
    page stays a safety net for a list cut outside `Req.cut_pages`."""
    if retractions != req.num_retractions:
        return 0
    if num_cuts != req.num_page_cuts:
        if req.num_page_cuts != num_cuts + 1:
            return 0
        num_pages = min(num_pages, req.num_pages_at_last_cut)
    elif has_spec and num_pages and (num_pages > len(req.pages) or req.pages[num_pages - 1] != last_page):
        return 0
    return num_pages


class Mirrors:
    """The worker side."""

    def __init__(self):
        self.reqs: dict[int, Req] = {}
        """rid -> mirror of each request in the previous step."""

    def apply(self, new_reqs: list[NewReq], items: StepItems | None) -> ScheduledBatch:
        mirrors = {}
        for new in new_reqs:
            req = Req(new.rid, new.prompt_ids, new.params, new.seed)
            req.token_ids = list(new.token_ids)
            mirrors[new.rid] = req
        batch = ScheduledBatch()
        if items is not None:
            columns = [items.column(name) for name in _ITEM_COLUMNS]
            rows = zip(*columns, items.ragged("new_token_ids"), items.ragged("new_pages"))
            for i, (rid, computed, num_new, pages_from, num_lps, inflight, sampling, wants_lps, tokens,
                    pages) in enumerate(rows):
                req = mirrors.get(rid) or self.reqs[rid]
                if tokens:
                    req.token_ids.extend(tokens)
                if pages_from == 0:
                    req.pages = pages
                else:
                    if len(req.pages) < pages_from:
                        raise RuntimeError(f"request {rid}: KV pages out of step with the engine "
                                           f"({len(req.pages)} held, the step extends from {pages_from})")
                    # Rejected drafts' pages given back since: cut as the engine did (the worker's page table
                    # reads the cut from the request, as the engine's does), then the pages taken anew.
                    req.cut_pages(pages_from)
                    req.pages.extend(pages)
                req.num_computed_tokens = computed
                if len(req.prompt_logprobs) != num_lps:
                    req.prompt_logprobs = [None] * num_lps
                req.grammar = items.bitmasks.get(i)
                req.num_inflight_tokens = inflight
                mirrors[rid] = req
                batch.items.append(ScheduledReq(req, computed, num_new, bool(sampling),
                                                items.draft_tokens.get(i, ()), bool(wants_lps)))
        for rid, req in self.reqs.items():
            if rid not in mirrors:
                req.finish("forgotten")
        self.reqs = mirrors
        return batch
