"""`cpkit cards` (placeholder until its feature lands)."""


def add_parser(sub):
    p = sub.add_parser("cards", help="(not implemented yet)")
    p.set_defaults(func=lambda args: print("cpkit cards: not implemented yet") or 2)
