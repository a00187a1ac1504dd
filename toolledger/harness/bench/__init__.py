"""``toolledger bench``: what the guarantee costs, against the limit and the peers."""
