"""Feature cards (`cards/<feature>/card.yaml`): what a CP feature means, how to use it, what is
known to hold, and which follow-up validations are covered by which pytest node ids.

Everything a card claims is checked: `check_cards` verifies the schema, that every evidence anchor
resolves, that every covering node id is collected by pytest, and that every measured number in a
card, a skill or the README is backed by a measured claim (`claims:`: value, command, evidence
folder, commit, machine, date, the code it is about); `card_status` shows (and with `run=True`
runs) the covering tests, and status reports show each claim fresh or stale. The schema is
documented in cards/README.md.

Modules, each importing only those listed before it: `schema` (vocabularies, loading, discovery),
`nodes` (the node-id matcher; junit files are read by cpkit.validation.junit), `freshness` (is a
recorded result or claim stale: git and the change map), `record` (`cpkit cards record`: a junit
file into last_result), `status` (the status report and its table), `upstream` (upstream cards, e.g. Megatron-Bridge's,
answered by cpkit's follow-ups: upstream.yaml, `cpkit cards status --upstream`), `claims` (what a
measured number is, which claim backs it, the generated claim blocks), `check` (check_cards and
collection); `render` (`python -m cpkit.cards.render`, not imported here) rewrites the generated
claim blocks.
"""

from cpkit.cards.check import Collected, ast_collect_node_ids, check_cards, claim_problems, collect_node_ids
from cpkit.cards.claims import measured_numbers, unbacked_numbers
from cpkit.cards.freshness import ChangeIndex, Freshness
from cpkit.cards.nodes import node_matches
from cpkit.cards.record import record_evidence, record_junit, write_last_result
from cpkit.cards.schema import (
    CARD_KEYS,
    CLAIM_KEYS,
    FOLLOW_UP_KEYS,
    FOLLOW_UP_STATUSES,
    GPUS_NEEDED,
    NEEDS,
    VALIDATION_STATUSES,
    OUTCOMES,
    TEST_OUTCOMES,
    Card,
    Claim,
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
    "VALIDATION_STATUSES", "FOLLOW_UP_STATUSES", "NEEDS", "GPUS_NEEDED", "CARD_KEYS", "FOLLOW_UP_KEYS", "CLAIM_KEYS",
    "OUTCOMES", "TEST_OUTCOMES", "LastResult", "FollowUp", "Claim", "Card", "CardError", "load_card", "load_cards", "card_dirs",
    "record_junit", "record_evidence", "write_last_result", "ChangeIndex", "Freshness", "verdict",
    "Collected", "collect_node_ids", "ast_collect_node_ids", "node_matches", "check_cards", "claim_problems",
    "measured_numbers", "unbacked_numbers",
    "card_status", "status_report", "format_status_table", "write_report", "FAILING_RESULTS",
    "UPSTREAM_FILE", "UpstreamMap", "check_upstream_maps", "format_upstream_table", "load_upstream_maps",
    "read_upstream_items", "upstream_status",
]
