package celeryproto

import "sync"

// Decoder decodes deliveries within its Limits. It is safe for concurrent use.
type Decoder struct {
	limits  Limits
	scratch sync.Pool // *scratch: the JSON parser's element stacks
}

// NewDecoder returns a Decoder; a zero limit takes its default.
func NewDecoder(l Limits) *Decoder {
	if l.MaxBodyBytes <= 0 {
		l.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if l.MaxDecodedBytes <= 0 {
		l.MaxDecodedBytes = DefaultMaxDecodedBytes
	}
	if l.MaxElements <= 0 {
		l.MaxElements = DefaultMaxElements
	}
	return &Decoder{limits: l, scratch: sync.Pool{New: newScratch}}
}

var defaultDecoder = NewDecoder(Limits{})

// Limits returns the decoder's limits, defaults filled in.
func (dec *Decoder) Limits() Limits { return dec.limits }

// Decode decodes d with the default limits.
func Decode(d *Delivery) (*Message, error) { return defaultDecoder.Decode(d) }

// knownHeaders are the protocol 2 headers that become Message fields; the
// others are kept in Message.Headers.
var knownHeaders = map[string]struct{}{
	"lang": {}, "task": {}, "id": {}, "shadow": {}, "eta": {}, "expires": {},
	"group": {}, "group_index": {}, "retries": {}, "timelimit": {}, "root_id": {},
	"parent_id": {}, "argsrepr": {}, "kwargsrepr": {}, "origin": {},
	"ignore_result": {}, "stamped_headers": {}, "stamps": {}, "compression": {},
}

// Decode decodes one delivery into a Message. Protocol 2 is recognised by
// the "task" header; otherwise the body must be a protocol 1 mapping with a
// "task" key. A protocol 2 header set with a protocol 1 style body (a
// mapping with "args") is the hybrid form: the body fields are read and the
// headers override them. Every error is a *DecodeError.
func (dec *Decoder) Decode(d *Delivery) (*Message, error) {
	m, _, err := dec.DecodeCost(d)
	return m, err
}

// DecodeCost is Decode that also returns what the decoded message costs in
// memory, as charged against Limits.MaxDecodedBytes (ElementCost per
// element plus the text).
func (dec *Decoder) DecodeCost(d *Delivery) (*Message, int64, error) {
	mt := newMeter(dec.limits)
	m, err := dec.decode(d, mt)
	return m, mt.bytes, err
}

func (dec *Decoder) decode(d *Delivery, mt *meter) (*Message, error) {
	if d == nil {
		return nil, decodeErr(ErrShape, nil, "nil delivery")
	}
	if err := unreadableHeaders(d); err != nil {
		return nil, err
	}
	if len(d.Body) > dec.limits.MaxBodyBytes {
		return nil, decodeErr(ErrTooLarge, nil, "body of %d bytes exceeds the limit of %d", len(d.Body), dec.limits.MaxBodyBytes)
	}
	ser, err := serializerFor(d.ContentType)
	if err != nil {
		return nil, err
	}
	m := &Message{
		ContentType: d.ContentType, ContentEncoding: d.ContentEncoding,
		ReplyTo: d.ReplyTo, CorrelationID: d.CorrelationID, Priority: d.Priority,
	}
	body := d.Body
	if c, ok := d.Headers["compression"]; ok && c != nil {
		cs, ok := c.(string)
		if !ok {
			return nil, decodeErr(ErrBadHeader, nil, "header compression must be a string, got %s", typeName(c))
		}
		if cs != "" { // kombu: an empty compression header means none
			if body, err = decompress(cs, body, dec.limits.MaxBodyBytes); err != nil {
				return nil, err
			}
			m.Compression = cs
		}
	}
	if ser == "yaml" && len(body) > maxYAMLBody {
		return nil, decodeErr(ErrTooLarge, nil, "yaml body of %d bytes exceeds the limit of %d for yaml", len(body), maxYAMLBody)
	}
	payload, err := dec.unmarshal(ser, body, mt)
	if err == nil && ser == "yaml" {
		// The YAML parser is not metered while it runs (its body is
		// bounded by maxYAMLBody); its values are charged once decoded.
		err = mt.chargeTree(payload)
	}
	if IsDecodeError(err) {
		return nil, err // a limit
	}
	if err != nil {
		return nil, decodeErr(ErrMalformed, err, "cannot decode %s body", ser)
	}
	if t, ok := d.Headers["task"]; ok && t != nil {
		if bm, ok := payload.(map[string]any); ok {
			if _, hybrid := bm["args"]; hybrid {
				return result(m, dec.decodeV1(m, bm, d.Headers))
			}
		}
		return result(m, dec.decodeV2(m, payload, d.Headers))
	}
	bm, ok := payload.(map[string]any)
	if !ok {
		return nil, decodeErr(ErrShape, nil, "no task header and the body is not a protocol 1 mapping, got %s", typeName(payload))
	}
	if _, ok := bm["task"]; !ok {
		return nil, decodeErr(ErrShape, nil, "no task header and no task in the protocol 1 body")
	}
	return result(m, dec.decodeV1(m, bm, d.Headers))
}

// result checks that the message names its task and id: without them it can
// be neither run nor answered.
func result(m *Message, err error) (*Message, error) {
	if err != nil {
		return nil, err
	}
	if m.Task == "" {
		return nil, decodeErr(ErrShape, nil, "protocol %d message without a task name", m.Protocol)
	}
	if m.ID == "" {
		return nil, decodeErr(ErrShape, nil, "protocol %d message without a task id", m.Protocol)
	}
	return m, nil
}

func (dec *Decoder) decodeV2(m *Message, payload any, h map[string]any) error {
	m.Protocol = 2
	parts, ok := payload.([]any)
	if !ok || len(parts) != 3 {
		if ok {
			return decodeErr(ErrShape, nil, "protocol 2 body must be a 3-element list, got %d elements", len(parts))
		}
		return decodeErr(ErrShape, nil, "protocol 2 body must be a 3-element list, got %s", typeName(payload))
	}
	var err error
	if m.Args, err = argsValue("args", parts[0]); err != nil {
		return err
	}
	if m.Kwargs, err = kwargsValue("kwargs", parts[1]); err != nil {
		return err
	}
	if parts[2] != nil {
		embed, ok := parts[2].(map[string]any)
		if !ok {
			return decodeErr(ErrShape, nil, "protocol 2 embed must be a mapping, got %s", typeName(parts[2]))
		}
		if err := m.readEmbed(embed, true); err != nil {
			return err
		}
	}
	return m.readFields(h, true)
}

func (dec *Decoder) decodeV1(m *Message, body map[string]any, h map[string]any) error {
	m.Protocol = 1
	var err error
	if m.Args, err = argsValue("args", body["args"]); err != nil {
		return err
	}
	if m.Kwargs, err = kwargsValue("kwargs", body["kwargs"]); err != nil {
		return err
	}
	if err := m.readEmbed(body, false); err != nil {
		return err
	}
	fields := body
	if g, ok := body["taskset"]; ok && g != nil {
		if _, has := body["group"]; !has || body["group"] == nil {
			fields["group"] = g
		}
	}
	if err := m.readFields(fields, false); err != nil {
		return err
	}
	if len(h) > 0 {
		// Hybrid: headers override the body's fields.
		return m.readFields(h, true)
	}
	return nil
}

func (m *Message) readEmbed(e map[string]any, withChain bool) error {
	var err error
	if m.Callbacks, err = signatures("callbacks", e["callbacks"]); err != nil {
		return err
	}
	if m.Errbacks, err = signatures("errbacks", e["errbacks"]); err != nil {
		return err
	}
	if withChain {
		if m.Chain, err = signatures("chain", e["chain"]); err != nil {
			return err
		}
	}
	if c := e["chord"]; c != nil {
		s, err := signature("chord", c)
		if err != nil {
			return err
		}
		m.Chord = &s
	}
	return nil
}

// readFields reads the task fields from protocol 2 headers or a protocol 1
// body. Absent keys leave the field as it is. headers says h is the AMQP
// headers: their custom keys are kept, and their times are AMQP timestamps.
func (m *Message) readFields(h map[string]any, headers bool) error {
	for k, v := range h {
		var err error
		switch k {
		case "task":
			m.Task, err = text(k, v)
		case "id":
			m.ID, err = text(k, v)
		case "shadow":
			m.Shadow, err = str(k, v)
		case "root_id":
			m.RootID, err = str(k, v)
		case "parent_id":
			m.ParentID, err = str(k, v)
		case "group":
			m.GroupID, err = str(k, v)
		case "origin":
			m.Origin, err = str(k, v)
		case "argsrepr":
			m.ArgsRepr, err = str(k, v)
		case "kwargsrepr":
			m.KwargsRepr, err = str(k, v)
		case "eta":
			m.ETA, err = timeValue(k, v, headers)
		case "expires":
			m.Expires, err = timeValue(k, v, headers)
		case "retries":
			var n int64
			n, _, err = intValue(k, v)
			if err == nil && (n < 0 || n > maxRetries) {
				err = decodeErr(ErrBadHeader, nil, "retries must be from 0 to %d, got %d", maxRetries, n)
			}
			m.Retries = int(n)
		case "group_index":
			var n int64
			var ok bool
			if n, ok, err = intValue(k, v); ok {
				i := int(n)
				m.GroupIndex = &i
			}
		case "timelimit":
			m.TimeLimit, err = timeLimitValue(v)
		case "ignore_result":
			m.IgnoreResult, err = boolValue(k, v)
		case "stamps":
			if v != nil {
				s, ok := asMap(v)
				if !ok {
					err = decodeErr(ErrBadHeader, nil, "%s must be a mapping, got %s", k, typeName(v))
				}
				m.Stamps = s
			}
		case "stamped_headers":
			m.StampedHeaders, err = stringList(k, v)
		default:
			if _, known := knownHeaders[k]; known || !headers {
				continue
			}
			if m.Headers == nil {
				m.Headers = make(map[string]any)
			}
			m.Headers[k] = v
		}
		if err != nil {
			return err
		}
	}
	return nil
}
