"""`cpkit layout` (placeholder until its feature lands)."""


def add_parser(sub):
    p = sub.add_parser("layout", help="(not implemented yet)")
    p.set_defaults(func=lambda args: print("cpkit layout: not implemented yet") or 2)
