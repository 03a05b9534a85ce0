-- Which process made a node's current registration: a random token chosen once per
-- process. A re-registration whose answer was lost (a client-side deadline that fired
-- after the commit) leaves a newer incarnation the process never learned; the token tells
-- that apart from another process taking the same node id, so the node registers again
-- instead of fencing itself for good. Not secret; no tenant or session data.
ALTER TABLE placement_nodes ADD COLUMN IF NOT EXISTS process text NOT NULL DEFAULT '';
