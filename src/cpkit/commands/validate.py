"""`cpkit validate` (placeholder until its feature lands)."""


def add_parser(sub):
    p = sub.add_parser("validate", help="(not implemented yet)")
    p.set_defaults(func=lambda args: print("cpkit validate: not implemented yet") or 2)
