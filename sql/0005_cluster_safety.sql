-- A drain requested for a node survives the node being declared dead and re-registering
-- from the same process (issue 9): the state column alone is overwritten by 'dead'.
ALTER TABLE placement_nodes ADD COLUMN IF NOT EXISTS drain_requested boolean NOT NULL DEFAULT false;

-- The timings the cluster's safety argument depends on (node_ttl > self_fence + margin)
-- hold across processes only if they are shared: the first process to bootstrap stores
-- its own, and every later node and manager is checked against them (issue 9, item 4).
ALTER TABLE placement_meta ADD COLUMN IF NOT EXISTS self_fence_ms bigint;
ALTER TABLE placement_meta ADD COLUMN IF NOT EXISTS node_ttl_ms bigint;
