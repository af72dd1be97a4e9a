"""Feature cards (`cards/<feature>/card.yaml`): what a CP feature means, how to use it, what is
known to hold, and which follow-up validations are covered by which pytest node ids.

Everything a card claims is checked: `check_cards` verifies the schema, that every evidence anchor
resolves and that every covering node id is collected by pytest; `card_status` shows (and with
`run=True` runs) the covering tests. The schema is documented in cards/README.md.

Modules, each importing only those listed before it: `schema` (vocabularies, loading, discovery),
`nodes` (the node-id matcher and junit reading), `freshness` (is a recorded result stale: git and
the change map), `record` (`cpkit cards record`: a junit file into last_result), `status` (the
status report and its table), `upstream` (upstream cards, e.g. Megatron-Bridge's, answered by
cpkit's follow-ups: upstream.yaml, `cpkit cards status --upstream`), `check` (check_cards and
collection).
"""

from cpkit.cards.check import Collected, ast_collect_node_ids, check_cards, collect_node_ids
from cpkit.cards.freshness import ChangeIndex, Freshness
from cpkit.cards.nodes import node_matches, read_junit
from cpkit.cards.record import record_evidence, record_junit, write_last_result
from cpkit.cards.schema import (
    CARD_KEYS,
    FOLLOW_UP_KEYS,
    FOLLOW_UP_STATUSES,
    GPUS_NEEDED,
    NEEDS,
    VALIDATION_STATUSES,
    OUTCOMES,
    TEST_OUTCOMES,
    Card,
    LastResult,
    CardError,
    FollowUp,
    card_dirs,
    load_card,
    load_cards,
)
from cpkit.cards.upstream import (
    UPSTREAM_FILE,
    UpstreamMap,
    check_upstream_maps,
    format_upstream_table,
    load_upstream_maps,
    read_upstream_items,
    upstream_status,
)
from cpkit.cards.status import FAILING_RESULTS, card_status, format_status_table, status_report, verdict, write_report

__all__ = [
    "VALIDATION_STATUSES", "FOLLOW_UP_STATUSES", "NEEDS", "GPUS_NEEDED", "CARD_KEYS", "FOLLOW_UP_KEYS",
    "OUTCOMES", "TEST_OUTCOMES", "LastResult", "FollowUp", "Card", "CardError", "load_card", "load_cards", "card_dirs",
    "read_junit", "record_junit", "record_evidence", "write_last_result", "ChangeIndex", "Freshness", "verdict",
    "Collected", "collect_node_ids", "ast_collect_node_ids", "node_matches", "check_cards",
    "card_status", "status_report", "format_status_table", "write_report", "FAILING_RESULTS",
    "UPSTREAM_FILE", "UpstreamMap", "check_upstream_maps", "format_upstream_table", "load_upstream_maps",
    "read_upstream_items", "upstream_status",
]
