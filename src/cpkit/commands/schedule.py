"""`cpkit schedule` (placeholder until its feature lands)."""


def add_parser(sub):
    p = sub.add_parser("schedule", help="(not implemented yet)")
    p.set_defaults(func=lambda args: print("cpkit schedule: not implemented yet") or 2)
