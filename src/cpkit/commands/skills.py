"""`cpkit skills` (placeholder until its feature lands)."""


def add_parser(sub):
    p = sub.add_parser("skills", help="(not implemented yet)")
    p.set_defaults(func=lambda args: print("cpkit skills: not implemented yet") or 2)
