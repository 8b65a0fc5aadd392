"""Reading texts: finding a corpus's files (`files`), loading them or a Hub dataset
(`loading`), what each row must hold (`rows`), reading them in order with a position to
resume from (`streams`), and where their tokens are cached (`cache_keys`). Below both of
their readers: preparation (tokenizing into stores) and streaming sources import this
package, and never each other."""
