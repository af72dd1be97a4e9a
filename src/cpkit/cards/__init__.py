"""Feature cards (`cards/<feature>/card.yaml`): what a CP feature means, how to use it, what is
known to hold, and which follow-up validations are covered by which pytest node ids.

Everything a card claims is checked: `check_cards` verifies the schema, that every evidence anchor
resolves and that every covering node id is collected by pytest; `card_status` shows (and with
`run=True` runs) the covering tests. The schema is documented in cards/README.md.

Modules: `schema` (vocabularies, loading, discovery), `check` (check_cards and collection),
`status` (the status report and its table), `upstream` (upstream cards, e.g. Megatron-Bridge's,
answered by cpkit's follow-ups: upstream.yaml, `cpkit cards status --upstream`).
"""

from cpkit.cards.check import Collected, ast_collect_node_ids, check_cards, collect_node_ids, node_matches
from cpkit.cards.schema import (
    CARD_KEYS,
    FOLLOW_UP_KEYS,
    FOLLOW_UP_STATUSES,
    GPUS_NEEDED,
    NEEDS,
    VALIDATION_STATUSES,
    Card,
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
from cpkit.cards.status import FAILING_RESULTS, card_status, format_status_table, status_report, write_report

__all__ = [
    "VALIDATION_STATUSES", "FOLLOW_UP_STATUSES", "NEEDS", "GPUS_NEEDED", "CARD_KEYS", "FOLLOW_UP_KEYS",
    "FollowUp", "Card", "CardError", "load_card", "load_cards", "card_dirs",
    "Collected", "collect_node_ids", "ast_collect_node_ids", "node_matches", "check_cards",
    "card_status", "status_report", "format_status_table", "write_report", "FAILING_RESULTS",
    "UPSTREAM_FILE", "UpstreamMap", "check_upstream_maps", "format_upstream_table", "load_upstream_maps",
    "read_upstream_items", "upstream_status",
]
