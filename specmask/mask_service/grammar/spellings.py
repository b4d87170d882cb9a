"""How the model spells forced text, learned from what it commits (a drafting heuristic).

Forced continuations (forced.py) tokenise the grammar's forced text canonically:
``","`` is one token, ``":"`` is one token. A model does not always emit the
canonical spelling. SmolLM2 under compact JSON separators writes ``,`` then
``"``, ``":`` then ``"``: it learned JSON with spaces, where the quote stands
alone. Every such forced draft is rejected by the target, which then emits its
own spelling of the same bytes.

The service sees both sides: the forced runs it hands out and, at the next
commit, the tokens the target actually emitted where each run started. So each
session keeps a vote: for a forced text whose canonical spelling starts with
token ``c``, which token did the target commit there (any token spelling a
prefix of the forced text; ``c`` itself included)? When another token has more
votes than ``c``, forced runs start that text with it and spell the rest
canonically (again subject to the vote at each token). A JSON document repeats
its punctuation at every key, so one request learns within its first keys.

Every commit votes twice: in its session's table and in one pooled over every
session of the tokenizer. A greedy request spells by the pooled votes (the
worker sets ``shared_spellings``): its output is the target's argmax chain
whatever the drafts, and it starts with what earlier requests taught. A sampled
request spells by its session's votes alone, so its drafts depend on its own
history only and a seeded request gives the same output however many requests
ran before it (drafts decide which random numbers a sampled step uses, never
the distribution it samples).

Only drafts change: a respelled run spells the same forced bytes, the grammar
accepts it token by token like any forced run, its rows are filled by the same
walk, and the target verifies it. Votes only steer which exact spelling is
proposed, never what may be emitted.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

# Distinct canonical tokens with votes kept per table: forced texts are punctuation and
# keys, a few hundred distinct first tokens in practice; past this no new one is tracked.
MAX_TRACKED = 4096


@dataclass
class Spellings:
    """Votes per canonical first token: token the target committed there -> count."""

    _votes: dict[int, dict[int, int]] = field(default_factory=dict)
    _preferred: dict[int, int] = field(default_factory=dict)  # canonical -> a different winner
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def vote(self, canonical: int, committed: int) -> None:
        """The target committed ``committed`` where a forced text spelled canonically from
        ``canonical`` started (the caller checked that ``committed`` spells a prefix of it)."""
        with self._lock:
            votes = self._votes.get(canonical)
            if votes is None:
                if len(self._votes) >= MAX_TRACKED:
                    return
                votes = self._votes[canonical] = {}
            votes[committed] = votes.get(committed, 0) + 1
            best = max(votes, key=lambda t: (votes[t], t == canonical))
            if best != canonical and votes[best] > votes.get(canonical, 0):
                self._preferred[canonical] = best
            else:
                self._preferred.pop(canonical, None)

    def preferred(self, canonical: int) -> int | None:
        """The token to start with instead of ``canonical``; None to keep it."""
        return self._preferred.get(canonical)

    def __bool__(self) -> bool:
        return bool(self._preferred)
