"""EP step messages (distributed/messages.py, distributed/mirrors.py) on CPU, without workers: columns round-trip,
the workers' mirrors follow the engine's requests through decode, retraction and absence, a decode step's
message is sized by what changed (not by the batch's context), and forgotten mirrors give their CUDA-graph page
table rows back."""
from __future__ import annotations

import pickle

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_rt.cuda_graph import PageTable
from deepinfer_rt.distributed.messages import COLUMNS, StepItems
from deepinfer_rt.distributed.mirrors import Mirrors, StepEncoder
from deepinfer_rt.request import Req
from deepinfer_rt.sampling_params import SamplingParams
from deepinfer_rt.scheduler.batch import ScheduledBatch, ScheduledReq

_NAMES = COLUMNS[:-2]
_INTS = st.integers(-(2**40), 2**40) | st.integers(0, 3)  # past int32 too (int64 columns), and repeated values


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 12).flatmap(lambda n: st.tuples(
    st.lists(st.lists(_INTS, min_size=n, max_size=n), min_size=len(_NAMES), max_size=len(_NAMES)),
    st.lists(st.lists(_INTS, max_size=3), min_size=n, max_size=n),
    st.lists(st.lists(st.integers(0, 2**31 - 1), max_size=3), min_size=n, max_size=n))))
def test_columns_round_trip(case):
    values, tokens, pages = case
    items = pickle.loads(pickle.dumps(StepItems.pack(dict(zip(_NAMES, values)), tokens, pages)))
    assert [items.column(name) for name in _NAMES] == values
    assert items.ragged("new_token_ids") == tokens and items.ragged("new_pages") == pages


def _req(rid: int, prompt_len: int) -> Req:
    req = Req(rid, list(range(rid, rid + prompt_len)), SamplingParams(max_new_tokens=1000), seed=rid)
    req.pages = list(range(1000 * rid, 1000 * rid + prompt_len))  # page size 1
    return req


def _decode(reqs: list[Req], token: int) -> None:
    """What the engine's step does to each request: its token appended, the prompt/last token computed, a page
    for the next."""
    for req in reqs:
        req.num_computed_tokens = len(req.token_ids)
        req.token_ids.append(token)
        req.pages.append(req.pages[-1] + 1)


def _step(encoder: StepEncoder, mirrors: Mirrors, reqs: list[Req],
          has_spec: bool = False) -> tuple[ScheduledBatch, bytes]:
    batch = ScheduledBatch([ScheduledReq(r, r.num_computed_tokens, len(r.token_ids) - r.num_computed_tokens, True)
                            for r in reqs])
    (msg,) = encoder.encode([batch], is_overlapped=False, has_spec=has_spec)
    payload = pickle.dumps(("step", msg), protocol=pickle.HIGHEST_PROTOCOL)
    msg = pickle.loads(payload)[1]
    return mirrors.apply(msg.new_reqs, msg.items), payload


def _assert_mirrored(batch: ScheduledBatch, reqs: list[Req]) -> None:
    assert [it.req.rid for it in batch.items] == [r.rid for r in reqs]
    for item, req in zip(batch.items, reqs):
        mirror = item.req
        assert mirror is not req
        assert (mirror.token_ids, mirror.pages, mirror.num_computed_tokens) == (
            req.token_ids, req.pages, req.num_computed_tokens)
        assert (item.start, item.num_new_tokens) == (req.num_computed_tokens,
                                                     len(req.token_ids) - req.num_computed_tokens)


def test_mirrors_follow_decode_retraction_and_absence():
    encoder, mirrors = StepEncoder(bitmask=None), Mirrors()
    reqs = [_req(rid, 3 + rid) for rid in range(4)]
    for step in range(6):
        live = [r for r in reqs if not (step == 3 and r.rid == 2)]  # request 2 sits out step 3
        if step == 4:  # request 1 retracted and re-admitted: new pages, prompt + outputs recomputed
            reqs[1].num_retractions += 1
            reqs[1].pages = [7000 + i for i in range(len(reqs[1].token_ids))]
            reqs[1].num_computed_tokens = 0
        batch, _ = _step(encoder, mirrors, live)
        _assert_mirrored(batch, live)
        if step == 3:
            assert 2 not in mirrors.reqs
        _decode(live, 100 + step)


def test_decode_message_is_sized_by_what_changed():
    sizes = {}
    for prompt_len in (32, 2000):
        encoder, mirrors = StepEncoder(bitmask=None), Mirrors()
        reqs = [_req(rid, prompt_len + rid % 7) for rid in range(256)]  # mixed lengths
        _, first = _step(encoder, mirrors, reqs)  # the prefill step carries every prompt
        _decode(reqs, 5)
        batch, payload = _step(encoder, mirrors, reqs)
        _assert_mirrored(batch, reqs)
        sizes[prompt_len] = len(payload)
        assert len(first) > 256 * prompt_len * 4  # the prompts' ids and pages
    # A decode step sends per request its id, computed count, page offset, new token and new page (4 bytes
    # each); every other column is one value. The context length does not show (but in a few pickled ints).
    assert abs(sizes[32] - sizes[2000]) <= 16 and sizes[2000] <= 256 * 20 + 1500, sizes
    items = pickle.loads(payload)[1].items
    assert sorted(n for n, c in items.columns.items() if isinstance(c, np.ndarray)) == [
        "num_computed_tokens", "pages_from", "rid"]


def test_forgotten_mirrors_give_their_graph_rows_back():
    """Rounds of requests that finish (drop out of the steps): without giving rows back, a table of 2 x 8 rows
    runs out in the third round of 8 and every later decode step would run without graphs."""
    encoder, mirrors = StepEncoder(bitmask=None), Mirrors()
    table = PageTable(num_rows=16, width=64, device=torch.device("cpu"))
    for round_ in range(6):
        reqs = [_req(8 * round_ + i, 4) for i in range(8)]
        for step in range(3):
            batch, _ = _step(encoder, mirrors, reqs)
            rows = table.rows([it.req for it in batch.items])
            assert rows is not None, f"round {round_}: the page table ran out of rows"
            _decode(reqs, step)
    _step(encoder, mirrors, [])  # a step without them: the last round's mirrors are forgotten too
    assert all(req.is_finished for req in (it.req for it in batch.items))


def test_pages_cut_by_rejected_drafts_and_regrown_around_the_old_last_page():
    """Speculation gives the pages past the verified tokens back (Req.cut_pages) and the next step's drafts take
    pages anew. Two pages cut, [.., C, D] -> [..], and regrown from the allocator's free list (popped from the
    end) after another request freed Z: [.., Z, D]. The last page the workers knew is back at its index while
    the page before it changed; the mirror must still hold the engine's list, and the worker's page table too
    (else the worker writes that position's KV to C, a free page another request is then given)."""
    encoder, mirrors = StepEncoder(bitmask=None), Mirrors()
    table = PageTable(num_rows=4, width=64, device=torch.device("cpu"))
    req = _req(0, 6)  # pages 0..5
    batch, _ = _step(encoder, mirrors, [req], has_spec=True)
    table.rows([it.req for it in batch.items])
    c, d = req.pages[-2:]
    req.cut_pages(len(req.pages) - 2)
    req.pages += [900, d]
    batch, _ = _step(encoder, mirrors, [req], has_spec=True)
    _assert_mirrored(batch, [req])
    (row,) = table.rows([it.req for it in batch.items])
    assert table.table[row, : len(req.pages)].tolist() == req.pages


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 3), st.lists(st.integers(0, 7), max_size=3)),
                max_size=12))
def test_mirror_pages_follow_cuts_and_regrowth(moves):
    """Any sequence of cuts (0-3 pages) and regrowths (pages drawn from a few ids, so old ones come back at
    their old index) on two requests: after each step every mirror's pages, and its page table row, are the
    engine's."""
    encoder, mirrors = StepEncoder(bitmask=None), Mirrors()
    table = PageTable(num_rows=8, width=64, device=torch.device("cpu"))
    reqs = [_req(0, 4), _req(1, 5)]
    for which, num_cut, grown in moves:
        batch, _ = _step(encoder, mirrors, reqs, has_spec=True)
        _assert_mirrored(batch, reqs)
        rows = table.rows([it.req for it in batch.items])
        for row, it in zip(rows, batch.items):
            assert table.table[row, : len(it.req.pages)].tolist() == reqs[it.req.rid].pages
        req = reqs[which]
        keep = max(1, len(req.pages) - num_cut)
        req.cut_pages(keep)
        req.pages += [1000 * which + p for p in grown]  # _req's own page ids among them
    batch, _ = _step(encoder, mirrors, reqs, has_spec=True)
    _assert_mirrored(batch, reqs)


def test_shipped_drafts_keep_the_drafters_confidences_exactly():
    """The engine plans from the floats the worker's drafter made (DSpark's are ratios of float32 survivals, not
    float32 themselves): a round trip through Drafts and pickle changes none of them."""
    from deepinfer_rt.distributed.messages import Drafts
    from deepinfer_rt.speculative.drafter import Proposal
    from deepinfer_rt.speculative.dspark import survival_to_confidences

    survival = torch.tensor([[0.9, 0.7, 0.31], [0.5, 0.5, 0.2]]).tolist()  # float32 values, as DSpark reads them
    proposals = {7: Proposal([3, 4, 5], survival_to_confidences(survival[0]), None, 12),
                 9: Proposal([6, 6, 1], survival_to_confidences(survival[1]), None, 30)}
    assert any(float(torch.tensor(c)) != c for p in proposals.values() for c in p.confidences)  # not float32
    shipped = pickle.loads(pickle.dumps(Drafts.pack(proposals))).proposals()
    assert {rid: (p.tokens, p.confidences, p.num_tokens) for rid, p in shipped.items()} == \
        {rid: (p.tokens, p.confidences, p.num_tokens) for rid, p in proposals.items()}
