"""`cpkit plan` (placeholder until its feature lands)."""


def add_parser(sub):
    p = sub.add_parser("plan", help="(not implemented yet)")
    p.set_defaults(func=lambda args: print("cpkit plan: not implemented yet") or 2)
